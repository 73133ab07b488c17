#!/usr/bin/perl

# What goes wrong, against the fake backend: access control before any
# slot call, the wait bound, clients that leave while waiting or
# mid-stream, arrival order, a slot still busy in the backend, failing
# saves and restores, a backend that is down or restarts, upstream errors
# and timeouts, and a reload under traffic.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep time);

my $JSON = $LlamaTest::JSON;

my $t = LlamaTest->new(workers => 2);
my $fake = $t->fake;

open my $pw, '>', $t->dir . '/htpasswd' or die;
print $pw "user:{PLAIN}secret\n";
close $pw;

$t->nginx(<<'EOF');
    llama_session_zone zone=llama:1m store=%%SLOTS%%;

    upstream llama { server 127.0.0.1:%%LLAMA%%; }

    server {
        listen 127.0.0.1:%%PORT%%;

        add_header X-S-Action $llama_session_action always;
        add_header X-S-Wait $llama_session_wait_ms always;

        llama_session llama;

        location / {
            proxy_pass http://llama;
            proxy_buffering off;
        }

        location /short/ {
            llama_session_wait_timeout 400ms;
            proxy_pass http://llama/;
        }

        location /quick/ {
            proxy_read_timeout 500ms;
            proxy_pass http://llama/;
        }

        location /redirect/ {
            proxy_intercept_errors on;
            error_page 500 = @again;
            proxy_pass http://llama/;
        }

        location @again {
            rewrite ^ /v1/completions break;
            proxy_pass http://llama;
        }

        location /denied/ {
            deny all;
            proxy_pass http://llama/;
        }

        location /basic/ {
            auth_basic "llama";
            auth_basic_user_file %%DIR%%/htpasswd;
            proxy_pass http://llama/;
        }

        location /authreq/ {
            auth_request /auth;
            proxy_pass http://llama/;
        }

        location = /auth {
            internal;
            llama_session off;
            return 403;
        }

        location /_llama_slots/ {
            internal;
            llama_session off;
            proxy_pass http://llama/;
        }

        # the test looks at the queue there
        location /api/ {
            llama_session off;
            llama_session_api llama;
        }
    }
EOF

my $chat = { messages => [ { role => 'user', content => 'hello' } ] };

sub ask {
    my ($sid, %o) = @_;
    my $path = delete $o{path} // '/v1/chat/completions';
    return $t->post($path, $o{body} // $chat,
                    headers => { 'X-Session-Id' => $sid,
                                 %{ $o{headers} // {} } });
}

sub slot_calls {
    return grep { $_->{path} =~ m{^/slots} } @{ $t->fake_calls };
}

sub completions {
    return grep { $_->{path} !~ m{^/slots} && $_->{method} eq 'POST'
                  && !LlamaTest::prefix_call($_) }
           @{ $t->fake_calls };
}

# how many requests of the session reached the backend (had the slot)
sub reached {
    my ($sid) = @_;
    return scalar grep { ($_->{headers}{'x-session-id'} // '') eq $sid }
                  completions();
}

# waits until one more request of the session has reached the backend
sub wait_reached {
    my ($sid, $before) = @_;
    $t->wait_for(sub { reached($sid) > $before }, 10)
        or diag "no request of $sid reached the backend";
}

# waits until that many requests wait for the slot in the zone's queue
sub wait_queued {
    my ($n) = @_;
    $t->wait_for(sub { ($t->get('/api/sessions/current')->{json}{waiting}
                        // 0) >= $n }, 10)
        or diag "$n requests never waited for the slot";
}

# warm up: the slot's content is unknown after nginx's start
is(ask('warm')->{status}, 200, 'a first request');

# access control runs before the module: no slot call for refused requests
my $n = slot_calls();
is(ask('intruder', path => '/denied/v1/chat/completions')->{status}, 403,
   'deny all: 403');
is(ask('intruder', path => '/basic/v1/chat/completions')->{status}, 401,
   'auth_basic without credentials: 401');
is(ask('intruder', path => '/authreq/v1/chat/completions')->{status}, 403,
   'auth_request refusing: 403');
is(scalar(slot_calls()), $n, 'refused requests made no slot call');
my $r = ask('member', path => '/basic/v1/chat/completions',
            headers => { Authorization => 'Basic dXNlcjpzZWNyZXQ=' });
is($r->{status}, 200, 'auth_basic with credentials: 200');
is($r->{headers}{'x-s-action'}, 'fresh', 'and it took the slot');

# the wait bound: 503, Retry-After and an OpenAI-style error
$t->fake_script({ completion => { delay_ms => 1500 } });
my $got = reached('slow');
my $slow = $t->async_post('/v1/chat/completions', $chat,
                          headers => { 'X-Session-Id' => 'slow' });
wait_reached('slow', $got);
my $t0 = time;
$r = ask('impatient', path => '/short/v1/chat/completions');
my $waited = time - $t0;
is($r->{status}, 503, 'the wait bound reached: 503');
is($r->{headers}{'retry-after'}, '1', 'with Retry-After');
is($r->{json}{error}{code}, 503, 'a JSON error with its code');
is($r->{json}{error}{type}, 'unavailable_error', 'and its type');
like($r->{json}{error}{message}, qr/busy/, 'and a message');
cmp_ok($waited, '<', 1.2, 'it came after the bound, not after the slot');
is($t->async_wait($slow)->{status}, 200, 'the slow request finished');
ok($t->log_lines(qr/session "impatient-\w+" waited \d+ ms for slot 0/),
   'the error log tells who waited in vain');

# a client that leaves while waiting: its place is dropped
$got = reached('slow');
$slow = $t->async_post('/v1/chat/completions', $chat,
                       headers => { 'X-Session-Id' => 'slow' });
wait_reached('slow', $got);
my $s = $t->raw_open('POST', '/v1/chat/completions', $chat,
                     headers => { 'X-Session-Id' => 'leaver' });
wait_queued(1);
close $s;
my $next = $t->async_post('/v1/chat/completions', $chat,
                          headers => { 'X-Session-Id' => 'after-leaver' });
is($t->async_wait($slow)->{status}, 200, 'the request in the slot finished');
$r = $t->async_wait($next, 10);
is($r->{status}, 200, 'the request behind the leaver was served');
ok($t->wait_for(sub { $t->read_file('access.log') =~ /" 499 / }, 5),
   'the leaver was logged as 499');
ok(!(grep { ($_->{headers}{'x-session-id'} // '') eq 'leaver' } completions()),
   'the leaver never reached the backend');
$t->fake_script({});

# arrival order; a session swapped in takes its waiting requests first
$t->fake_script({ completion => { delay_ms => 400 } });
my @h;
$got = reached('holder');
push @h, $t->async_post('/v1/chat/completions', $chat,
                        headers => { 'X-Session-Id' => 'holder' });
wait_reached('holder', $got);
my $queued = 0;
for my $sid (qw(B1 A1 B2 A2)) {
    my $sess = substr($sid, 0, 1);
    push @h, $t->async_post('/v1/chat/completions',
                            { %$chat, tag => $sid },
                            headers => { 'X-Session-Id' => "order-$sess" });
    wait_queued(++$queued);
}
my @res = map { $t->async_wait($_) } @h;
is(scalar(grep { $_->{status} == 200 } @res), 5, 'all five were served');
my @order = map { $JSON->decode($_->{body})->{tag} }
            grep { ($_->{body} // '') =~ /"tag"/ } completions();
is_deeply([ @order[-4 .. -1] ], [ qw(B1 B2 A1 A2) ],
          'served in arrival order, a swapped-in session\'s waiters first');
$t->fake_script({});

# a slot the backend still runs (a stream whose client left): wait for it
$t->fake_script({ completion => { chunks => 8, chunk_ms => 150 } });
$s = $t->raw_open('POST', '/v1/chat/completions',
                  { %$chat, stream => JSON::PP::true },
                  headers => { 'X-Session-Id' => 'streamer' });
my $line = <$s>;
like($line, qr/200/, 'a stream started');
close $s;
$t0 = time;
$r = ask('after-stream');
my $took = time - $t0;
is($r->{status}, 200, 'the next session was served after the stream');
my @gets = grep { $_->{method} eq 'GET' && $_->{time} >= $t0 } slot_calls();
cmp_ok(scalar @gets, '>', 1,
       'the module asked GET /slots again while the backend was busy');
my ($save) = grep { $_->{query} eq 'action=save' && $_->{time} >= $t0 }
             slot_calls();
ok($save && $save->{body} =~ /streamer-/,
   'then it saved the streamed session');
$t->fake_script({});

# a failing save keeps the previous file, the request goes on
ask('keeper');
ask('other');                        # keeper saved
my ($kfile) = glob($t->dir . '/slots/keeper-*.bin');
ok($kfile, 'keeper has a file');
my $before = $t->read_file($kfile);
is(ask('keeper')->{headers}{'x-s-action'}, 'restore', 'keeper restored');
ask('keeper', body => { messages => [ { role => 'user',
                                        content => 'changed' } ] });
$t->fake_script({ save => { status => 500, message => 'Unable to save slot' } });
$r = ask('other');
is($r->{status}, 200, 'a failing save: the request goes on');
ok($t->log_lines(qr/saving session "keeper-\w+" from slot 0 failed \(500/),
   'the failed save is logged');
is($t->read_file($kfile), $before, 'the previous file is untouched');
ok(!glob($t->dir . '/slots/*.tmp'), 'no temporary file is left');
$t->fake_script({});
is(ask('keeper')->{headers}{'x-s-action'}, 'restore',
   'keeper is restored from its previous file');

# a file deleted behind our back: restore 400, fresh, logged
ask('other');
unlink glob($t->dir . '/slots/keeper-*.bin');
$r = ask('keeper');
is($r->{status}, 200, 'a missing file: the request goes on');
is($r->{headers}{'x-s-action'}, 'fresh', 'with a fresh slot');
ok($t->log_lines(qr/restoring session "keeper-\w+" into slot 0 failed \(400/),
   'the failed restore is logged');

# an upstream error: the slot's content is unknown, never saved
$t->fake_script({ completion => { status => 500 } });
is(ask('broken')->{status}, 500, 'the backend fails a request');
$t->fake_script({});
$n = slot_calls();
$r = ask('broken');
isnt($r->{headers}{'x-s-action'}, 'hit', 'the next request is no hit');
ok(!(grep { $_->{query} eq 'action=save' }
     (slot_calls())[ $n .. scalar(slot_calls()) - 1 ]),
   'and nothing was saved from the unknown slot');

# an internal redirect does not acquire twice (it would wait on itself)
$t->fake_script({ completion => { status => 500,
                                  path => '/v1/chat/completions' } });
$t0 = time;
$r = ask('redirected', path => '/redirect/v1/chat/completions');
$t->fake_script({});
is($r->{status}, 200, 'an internal redirect after an error is served');
cmp_ok(time - $t0, '<', 5, 'at once, without waiting for itself');

# an upstream timeout releases the slot too
$t->fake_script({ completion => { delay_ms => 1500 } });
is(ask('timeout', path => '/quick/v1/chat/completions')->{status}, 504,
   'an upstream timeout: 504');
$t->fake_script({});
$t0 = time;
is(ask('after-timeout')->{status}, 200, 'the next request is served');

# the backend down: 502 with a JSON error; back: works, nothing clobbered
$t->stop_proc('fake');
$r = ask('down');
is($r->{status}, 502, 'the backend is down: 502');
is($r->{json}{error}{type}, 'server_error', 'with a JSON error');
ok($t->log_lines(qr/slot call "GET \/slots" for session "down-\w+" got no answer/),
   'the error log names the failed call');
$t->fake(port => $fake);
$n = slot_calls();
$r = ask('down');
is($r->{status}, 200, 'the backend is back: 200');
my @calls = slot_calls();
ok(!(grep { $_->{query} eq 'action=save' } @calls[ $n .. $#calls ]),
   'nothing was saved from the slot nobody could vouch for')
    or diag $JSON->encode([ @calls[ $n .. $#calls ] ]);
is(ask('down')->{headers}{'x-s-action'}, 'hit', 'and the next turn is a hit');

# a reload under traffic: the zone survives, the stream completes
$t->fake_script({ completion => { delay_ms => 800 } });
$got = reached('reloaded');
$slow = $t->async_post('/v1/chat/completions', $chat,
                       headers => { 'X-Session-Id' => 'reloaded' });
wait_reached('reloaded', $got);
$t->reload;
my $waiter = $t->async_post('/v1/chat/completions', $chat,
                            headers => { 'X-Session-Id' => 'reloaded' });
is($t->async_wait($slow)->{status}, 200, 'the request across the reload');
$r = $t->async_wait($waiter);
is($r->{status}, 200, 'a request during the reload');
is($r->{headers}{'x-s-action'}, 'hit',
   'the new workers know what the slot holds');
$t->fake_script({});

$t->stop;
done_testing;
