#!/usr/bin/perl

# Faults with the real llama-server: kill -9 of llama-server in the middle
# of a save (the previous file stays whole and is restored after its
# restart), a full disk under the store folder (a save that cannot be
# whole never replaces the previous file), and damaged files (a restore
# that fails starts the session fresh, never crosses sessions).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep time);

my $JSON = $LlamaTest::JSON;

my $t = LlamaTest->new(workers => 2, timeout => 300);
my $llama = $t->llama;
my $slots = $t->dir . '/slots';

my $HTTP = $t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%STORE%%;',
    upstream => '',
    server => 'add_header X-S-Action $llama_session_action always;',
    location => 'proxy_read_timeout 300s;',
    slots => 'proxy_read_timeout 300s;');

$t->nginx($HTTP =~ s/%%STORE%%/%%SLOTS%%/r);

my $words = join ' ', map { "word$_" } 1 .. 4000;

sub body {
    my ($name, $len) = @_;
    return { max_tokens => 2, temperature => 0,
             messages => [ { role => 'user',
                             content => "This is conversation $name." },
                           { role => 'assistant', content => 'Go on.' },
                           { role => 'user',
                             content => substr($words, 0, $len) } ] };
}

sub ask {
    my ($name, $len) = @_;
    my $r = $t->post('/v1/chat/completions', body($name, $len // 200),
                     headers => { 'X-Session-Id' => $name });
    $r->{cached} = $r->{json}{usage}{prompt_tokens_details}{cached_tokens};
    $r->{action} = $r->{headers}{'x-s-action'};
    return $r;
}

sub file_of { (glob("$slots/$_[0]-*.bin"))[0] }

# kill -9 of llama-server while it saves
my $r = ask('alpha', 2000);
is($r->{status}, 200, 'alpha, a long conversation');
ask('beta');                                       # alpha saved
my $afile = file_of('alpha');
ok($afile, 'alpha has a file');
my $asize = -s $afile;
ask('alpha', 16000);                               # alpha grows, unsaved

my $h = $t->async_post('/v1/chat/completions', body('gamma', 200),
                       headers => { 'X-Session-Id' => 'gamma' });
my $caught = 0;
my $end = time + 60;
while (time < $end) {
    if (glob("$afile.tmp")) {
        kill 'KILL', $t->{pids}{llama};
        $caught = 1;
        last;
    }
    sleep 0.001;
}
my $res = $t->async_wait($h);
SKIP: {
    skip 'the save ended before it could be caught', 4 unless $caught;
    ok($caught, 'llama-server was killed in the middle of saving alpha');
    is($res->{status}, 502, 'the request behind the save got 502');
    like($res->{content}, qr/"type":"server_error"/, 'with a JSON error');
    is(-s $afile, $asize, 'alpha\'s previous file is whole');
}
$t->stop_proc('llama');
$t->llama(port => $llama);
ok(!glob("$slots/*.tmp"), 'no temporary file stays');
$r = ask('alpha', 2000);
is($r->{action}, 'restore', 'after the restart alpha is restored');
cmp_ok($r->{cached}, '>', 500,
       "from its previous file ($r->{cached} tokens cached)");

# damaged files: a restore that fails starts fresh
ask('beta');
my $bfile = file_of('beta');
ask('delta');                                      # beta saved again
open my $fh, '+<', $bfile or die;
seek $fh, 200, 0;
print $fh "\0" x 4096;
close $fh;
truncate $bfile, (-s $bfile) - 1000;
$r = ask('beta');
is($r->{status}, 200, 'a truncated file: the request goes on');
is($r->{action}, 'fresh', 'and starts fresh');
is($r->{cached} // 0, 0, 'with no cached tokens');
ok($t->log_lines(qr/restoring session "beta-\w+" into slot 0 failed \(400/),
   'the failed restore is logged');

# a full disk under the store folder
$t->stop_nginx;
my $small = $t->dir . '/small';
mkdir $small;
my $mounted = system("mount -t tmpfs -o size=12m tmpfs $small 2>/dev/null")
              == 0;
SKIP: {
    skip 'cannot mount a small tmpfs here', 5 unless $mounted;
    LlamaTest::slots_dir($small, (getpwnam($LlamaTest::LLAMA_USER))[2]);
    $t->stop_llama;
    $t->llama(port => $llama, slots => $small);
    $t->nginx($HTTP =~ s/%%STORE%%/$small/r);
    ask('epsilon', 200);
    ask('zeta', 200);                             # epsilon saved, small
    my $efile = (glob("$small/epsilon-*.bin"))[0];
    ok($efile, 'epsilon has a small file');
    my $esize = -s $efile;
    ask('epsilon', 6000);                          # 3k tokens: ~24 MB
    $r = ask('zeta', 200);
    is($r->{status}, 200, 'a save that does not fit: the request goes on');
    is(-s $efile, $esize, 'epsilon\'s previous file is untouched');
    ok($t->log_lines(qr/saving session "epsilon-\w+" from slot 0 failed|is not the file llama-server said it wrote/),
       'the failed save is logged');
    $r = ask('epsilon', 2000);
    is($r->{action}, 'restore', 'epsilon is restored from its small file');
    $t->stop_nginx;
    $t->stop_llama;
    system("umount $small");
}

$t->stop;
done_testing;
