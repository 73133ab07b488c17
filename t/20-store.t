#!/usr/bin/perl

# Sessions that survive restarts, against the fake backend: the index built
# from the store folder at start, atomic saves (a save killed half way
# leaves the previous file whole), never clobbering a file from a slot
# nobody can vouch for (a restarted backend), fingerprints and stale files,
# eviction by max_files, idle saves, a store folder nginx cannot write,
# and the management API.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use Digest::SHA qw(sha256_hex);
use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep time);

my $JSON = $LlamaTest::JSON;

sub fp { LlamaTest::fake_fp($_[0]) }
# a turn of a conversation: the same first message, then the text; the
# session's key has that first message in it
sub turn_body { LlamaTest::conversation($_[0]) }
sub key { my ($id, $model) = @_;
          LlamaTest::session_key($id, model => $model,
                                 body => turn_body('')) }

my $t = LlamaTest->new(workers => 2);
my $slots = $t->dir . '/slots';
mkdir $slots;

# a folder as a previous run left it
my $fp = fp('fake.gguf');
my $old = fp('old-model.gguf');

sub put {
    my ($name, $text, $meta, $mtime) = @_;
    open my $fh, '>', "$slots/$name.bin" or die;
    print $fh $JSON->encode({ text => $text, n => length $text });
    close $fh;
    if ($meta) {
        open $fh, '>', "$slots/$name.json" or die;
        print $fh $JSON->encode($meta);
        close $fh;
    }
    utime $mtime, $mtime, "$slots/$name.bin" if $mtime;
}

my $alpha = key('alpha');
put("$alpha.$fp", $JSON->encode(turn_body('alpha history')->{messages}),
    { id => 'alpha', model => '', tokens => 40 }, time - 100);
put(key('beta') . ".$old", 'beta', { id => 'beta', model => 'old' },
    time - 50);
open my $fh, '>', "$slots/" . key('gamma') . ".$fp.bin.tmp" or die;
print $fh 'half';
close $fh;
open $fh, '>', "$slots/unrelated.txt" or die;
close $fh;

# a save that died between its renames: the previous file was moved aside
my $omega = key('omega');
put("$omega.$fp", 'omega', { id => 'omega' }, time - 80);
rename "$slots/$omega.$fp.bin", "$slots/$omega.$fp.bin.old" or die;
open $fh, '>', "$slots/$alpha.$fp.bin.old" or die;
print $fh 'an older alpha';
close $fh;

my $fake = $t->fake;
my $http = $t->site(
    zone => q{
        llama_session_zone zone=llama:1m store=%%SLOTS%% max_files=4
                           save_idle=1s;
    },
    upstream => '',
    server => q{
        add_header X-S-Action $llama_session_action always;
        add_header X-S-Key $llama_session_key always;
    },
    extra => q{
        location /api/ {
            llama_session_api llama;
            allow 127.0.0.1;
            deny all;
        }

        location /locked/ {
            llama_session_api llama;
            deny all;
        }
    });
$t->nginx($http);

ok($t->log_lines(qr/llama_session zone "llama": 3 saved sessions, \d+ bytes/),
   'at start the index has the three files of the folder');
ok(-e "$slots/$omega.$fp.bin", 'a file moved aside by a dead save is back');
ok(!-e "$slots/$alpha.$fp.bin.old",
   'an old copy beside a whole file is deleted');
like($t->read_file("$slots/$alpha.$fp.bin"), qr/alpha history/,
     'and the whole file is kept');
ok(!-e "$slots/" . key('gamma') . ".$fp.bin.tmp",
   'the leftover of an interrupted save is gone');
ok(-e "$slots/unrelated.txt", 'files of other names are left alone');

my $list = $t->get('/api/sessions')->{json};
is($list->{files}, 3, 'the API lists three saved sessions');
my ($a) = grep { $_->{key} eq $alpha } @{ $list->{sessions} };
ok($a, 'alpha is listed by its key');
is($a->{id}, 'alpha', 'with its id from the .json');
is($a->{fingerprint}, $fp, 'and its fingerprint');

# a request after the "reboot": alpha comes back from its file
my $chat = turn_body('alpha history');
my $r = $t->post('/v1/chat/completions', $chat,
                 headers => { 'X-Session-Id' => 'alpha' });
is($r->{status}, 200, 'alpha after a restart');
is($r->{headers}{'x-s-action'}, 'restore', 'alpha is restored from its file');
is($r->{json}{timings}{cache_n},
   length($JSON->encode(turn_body('alpha history')->{messages})),
   'the restored state serves the whole prompt from the cache');

$list = $t->get('/api/sessions')->{json};
is($list->{fingerprint}, $fp, 'the zone knows the backend\'s fingerprint');
my ($b) = grep { $_->{id} eq 'beta' } @{ $list->{sessions} };
ok($b && $b->{stale}, 'a file of another configuration is stale');
ok((grep { $_->{key} eq $alpha && !$_->{stale} && $_->{in_slot} }
    @{ $list->{sessions} }), 'alpha is current and in the slot');

# the current slot
my $cur = $t->get('/api/sessions/current')->{json};
is($cur->{slots}[0]{state}, 'session', 'current: the slot holds a session');
is($cur->{slots}[0]{session}{key}, $alpha, 'current: alpha');
is($cur->{slots}[0]{session}{id}, 'alpha', 'current: with its id');
ok($cur->{slots}[0]{file}{saved}, 'current: alpha has a file');
is($cur->{backend}{model_path}, 'fake.gguf', 'current: the backend\'s model');
is($cur->{backend}{fingerprint}, $fp, 'current: its fingerprint');

# idle save: alpha changed, and one second later it is on disk
my $t0 = time;
my $before = -M "$slots/$alpha.$fp.bin";
$r = $t->post('/v1/chat/completions',
              turn_body('alpha more'),
              headers => { 'X-Session-Id' => 'alpha' });
ok($t->wait_for(sub { $t->read_file("$slots/$alpha.$fp.bin") =~ /alpha more/ },
               10), 'the idle save wrote the latest turn, with no request '
                    . 'behind it');
ok($t->wait_for(sub { $t->log_lines(qr/idle save of "$alpha" from slot 0 of zone "llama"/) }, 10),
   'the idle save is logged');
my @idle = grep { $_->{query} eq 'action=save' && $_->{time} >= $t0
                  && ($_->{headers}{'user-agent'} // '') =~ /llama-session/ }
           @{ $t->fake_calls };
is(scalar @idle, 1, 'through the module\'s own connection, once');
cmp_ok($idle[0]{time} - $t0, '>=', 1, 'not before save_idle');
ok($t->wait_for(sub { !$t->get('/api/sessions/current')->{json}{slots}[0]
                                {changed_since_save} }, 10),
   'the slot is clean after the idle save');
# a fixed time on purpose: longer than save_idle=1s, in which a second
# save of the clean slot would have happened
sleep 1.5;
is(scalar(grep { $_->{query} eq 'action=save' && $_->{time} >= $t0 }
          @{ $t->fake_calls }), 1, 'a clean slot is not saved again');

# a save killed half way leaves the previous file whole
my $whole = $t->read_file("$slots/$alpha.$fp.bin");
$t->post('/v1/chat/completions',
         turn_body('alpha again'),
         headers => { 'X-Session-Id' => 'alpha' });
$t->fake_script({ save => { partial => 1 } });
$r = $t->post('/v1/chat/completions', $chat,
              headers => { 'X-Session-Id' => 'delta' });
is($r->{status}, 502, 'the backend died during the save: 502');
is($t->read_file("$slots/$alpha.$fp.bin"), $whole,
   'the previous file is whole');
# (deleted in a thread of the store's, off the request's path)
ok($t->wait_for(sub { !glob("$slots/*.tmp") }, 5),
   'the half-written temporary file is gone');
$t->fake_script({});

# never clobber: the backend restarts and runs someone else's prompt;
# the zone thought alpha was in the slot
$t->post('/v1/chat/completions', $chat, headers => { 'X-Session-Id' => 'alpha' });
$t->post('/v1/chat/completions',
         turn_body('alpha changed'),
         headers => { 'X-Session-Id' => 'alpha' });
$t->post('/v1/chat/completions', $chat, headers => { 'X-Session-Id' => 'eps' });
$t->post('/v1/chat/completions',
         turn_body('alpha last'),
         headers => { 'X-Session-Id' => 'alpha' });
$whole = $t->read_file("$slots/$alpha.$fp.bin");
$t->stop_proc('fake');
$t->fake(port => $fake);
$t->post('/v1/chat/completions',
         turn_body('a stranger'),
         port => $fake);
$r = $t->post('/v1/chat/completions', $chat,
              headers => { 'X-Session-Id' => 'zeta' });
is($r->{status}, 200, 'a request after the backend restarted');
ok($t->log_lines(qr/llama-server restarted \(slot 0 shows task \d+\), the slot no longer holds "$alpha"/),
   'the restart was noticed');
is($t->read_file("$slots/$alpha.$fp.bin"), $whole,
   'alpha\'s file was not overwritten with the stranger\'s state');
unlike($t->read_file("$slots/$alpha.$fp.bin"), qr/stranger/,
       'nothing of the stranger in alpha\'s file');

# eviction: max_files=4, least recently used first, never the one in use
for my $sid (qw(s1 s2 s3 s4 s5 s6)) {
    $t->post('/v1/chat/completions',
             turn_body("hello $sid"),
             headers => { 'X-Session-Id' => $sid });
}
my @bins = glob("$slots/*.bin");
cmp_ok(scalar @bins, '<=', 4, 'at most max_files files');
ok($t->log_lines(qr/evicted session "[\w-]+\.\w+" \(\d+ bytes\) to keep zone "llama" within max_files=4/),
   'evictions are logged');
ok(-e "$slots/" . key('s5') . ".$fp.bin", 'the most recent ones stay');
ok($t->wait_for(sub { !-e "$slots/" . key('s1') . ".$fp.bin" }, 5),
   'the least recently used went (in a thread of the store\'s)');
$list = $t->get('/api/sessions')->{json};
is($list->{files}, scalar(@bins), 'the API agrees with the folder');

# the API: delete
my $s5 = key('s5');
$r = $t->request('DELETE', "/api/sessions/$s5");
is($r->{status}, 200, 'DELETE a saved session');
# (the index forgets it at once; the files go in a thread of the store's)
ok($t->wait_for(sub { !-e "$slots/$s5.$fp.bin" }, 5), 'its file is gone');
ok($t->wait_for(sub { !-e "$slots/$s5.$fp.json" }, 5), 'and its .json');
is($t->request('DELETE', "/api/sessions/$s5")->{status}, 404,
   'DELETE it again: 404');
is($t->request('DELETE', '/api/sessions/never-seen')->{status}, 404,
   'DELETE an unknown id: 404');
$r = $t->request('DELETE', '/api/sessions/s6');
is($r->{status}, 409, 'DELETE the session in the slot: 409');
is($r->{json}{error}{code}, 409, 'with a JSON error');

# save now, then clear
$t->post('/v1/chat/completions',
         turn_body('six changed'),
         headers => { 'X-Session-Id' => 's6' });
$r = $t->post('/api/sessions/save', '');
is($r->{status}, 200, 'POST save');
is($r->{json}{saved}[0]{key}, key('s6'), 'it saved the session in the slot');
like($t->read_file("$slots/" . key('s6') . ".$fp.bin"), qr/six changed/,
     'with its latest turn');
$r = $t->post('/api/sessions/clear', '');
is($r->{status}, 200, 'POST clear');
is($t->get('/api/sessions/current')->{json}{slots}[0]{state}, 'empty',
   'the slot is empty');
my @erase = grep { $_->{query} eq 'action=erase' } @{ $t->fake_calls };
ok(@erase, 'through an erase');
is($t->post('/v1/chat/completions', $chat,
            headers => { 'X-Session-Id' => 's6' })->{headers}{'x-s-action'},
   'restore', 's6 is restored after the clear');

# wrong methods, unknown paths, access control
$r = $t->request('POST', '/api/sessions', body => {});
is($r->{status}, 405, 'POST on the list: 405');
is($r->{headers}{allow}, 'GET, HEAD', 'with Allow');
is($t->request('GET', '/api/sessions/clear')->{headers}{allow}, 'POST',
   'GET on clear: 405 with Allow: POST');
is($t->request('PUT', '/api/sessions/x', body => {})->{headers}{allow},
   'GET, HEAD, DELETE', 'PUT on a session: Allow: GET, HEAD, DELETE');
is($t->get('/api/nothing')->{status}, 404, 'an unknown API path: 404');
is($t->get('/locked/sessions')->{status}, 403,
   'the API behind deny all: 403');

# a file damaged behind our back: restore 400, fresh, logged
my $s4 = key('s4');
open $fh, '>', "$slots/$s4.$fp.bin" or die;
print $fh 'garbage';
close $fh;
$r = $t->post('/v1/chat/completions', $chat, headers => { 'X-Session-Id' => 's4' });
is($r->{status}, 200, 'a damaged file: the request goes on');
is($r->{headers}{'x-s-action'}, 'fresh', 'with a fresh slot');
ok($t->log_lines(qr/restoring session "$s4" into slot 0 failed \(400/),
   'the failed restore is logged');

# the backend comes back with another model: old files are never restored
$t->stop_proc('fake');
$t->fake(port => $fake, model => 'other-model.gguf');
$r = $t->post('/v1/chat/completions', $chat, headers => { 'X-Session-Id' => 's3' });
is($r->{status}, 200, 'a request after the model changed');
is($r->{headers}{'x-s-action'}, 'fresh',
   's3\'s file of the old model is not restored');
ok(!(grep { $_->{query} eq 'action=restore' && $_->{body} =~ /s3-/ }
     @{ $t->fake_calls }), 'no restore was even tried');
$list = $t->get('/api/sessions')->{json};
ok((grep { $_->{key} eq key('s3') && $_->{stale} } @{ $list->{sessions} }),
   'the API shows s3\'s old file as stale');
ok($t->log_lines(qr/the backend of zone "llama" has a new configuration/),
   'the new configuration is logged');

# a store folder that is not there, or that the workers cannot write:
# nginx -t and the start say so, with the fix
$t->stop_nginx;
$t->allow_alerts(qr/the store folder "\/nonexistent\/llama-slots" is not there/,
                 qr/cannot list, rename and delete/);
my $conf = $t->read_file('nginx.conf');
(my $bad = $http) =~ s{store=\S+}{store=/nonexistent/llama-slots};
my ($rc, $out) = $t->nginx_test($bad);
isnt($rc, 0, 'nginx -t refuses a store folder that is not there');
like($out, qr/the store folder "\/nonexistent\/llama-slots" is not there/,
     'and names it');
my $locked = $t->dir . '/locked';
mkdir $locked;
chmod 0755, $locked;
($bad = $http) =~ s{store=\S+}{store=$locked};
($rc, $out) = $t->nginx_test($bad);
isnt($rc, 0, 'nginx -t refuses a store folder the workers cannot write');
like($out, qr/nginx's workers \(user "www-data"\) cannot list, rename and delete the files llama-server writes in "\Q$locked\E".*chmod 2775/,
     'and says what to run');

# the folder taken away while nginx runs: the save is lost, not the old file
open $fh, '>', $t->dir . '/nginx.conf' or die;
print $fh $conf =~ s{ max_files=4}{}r;
close $fh;
$t->start_nginx;
$t->post('/v1/chat/completions', $chat, headers => { 'X-Session-Id' => 'w1' });
chmod 0755, $slots;
chown 0, 0, $slots;
$r = $t->post('/v1/chat/completions', $chat,
              headers => { 'X-Session-Id' => 'w2' });
is($r->{status}, 200, 'requests go on when the rename fails');
ok($t->log_lines(qr/is store= the folder of llama-server's --slot-save-path and writable/),
   'the failed rename says what to check');

$t->stop;
done_testing;
