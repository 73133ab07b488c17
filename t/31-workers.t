#!/usr/bin/perl

# Workers that die, against the fake backend: kill -9 of the worker that
# holds the slot in the middle of a restore (the slot is freed and
# unknown, nobody runs on it as a hit), and of a worker whose request
# waits in the middle of the queue as one of the swapped-in session's
# (nobody waits behind it until a timeout).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep time);

my $JSON = $LlamaTest::JSON;

my $t = LlamaTest->new(workers => 2);
$t->fake;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    upstream => '',
    server => q{
        add_header X-S-Action $llama_session_action always;
        add_header X-S-Wait $llama_session_wait_ms always;
    },
    location => 'llama_session_wait_timeout 40s;',
    extra => 'location /api/ { llama_session_api llama; }'));

$t->allow_alerts(qr/worker process \d+ exited on signal 9/,
                 qr/died holding slot/);

# a turn of a conversation: the same first message, then the text
sub chat_of { LlamaTest::conversation($_[0]) }

sub ask {
    my ($sid, $text) = @_;
    return $t->post('/v1/chat/completions', chat_of($text // "hi $sid"),
                    headers => { 'X-Session-Id' => $sid });
}

# which worker holds the server side of a client's connection
sub worker_of {
    my ($sock) = @_;
    my $port = sprintf '%04X', $sock->sockport;
    my $inode;
    for my $f ('/proc/net/tcp', '/proc/net/tcp6') {
        open my $fh, '<', $f or next;
        while (<$fh>) {
            my @c = split;
            # a TIME_WAIT entry of an earlier connection from the same
            # port (loopback reuses them) has no inode: not this one
            next unless @c > 9 && $c[2] =~ /:$port$/ && $c[9];
            $inode = $c[9];
            last;
        }
        close $fh;
        last if $inode;
    }
    return undef unless $inode;
    my $master = $t->{pids}{nginx};
    for my $d (glob '/proc/[0-9]*') {
        my $pid = $d =~ s{/proc/}{}r;
        open my $fh, '<', "$d/stat" or next;
        my ($ppid) = (<$fh> // '') =~ /\)\s+\S+\s+(\d+)/;
        close $fh;
        next unless $ppid && $ppid == $master;
        for my $fd (glob "$d/fd/*") {
            my $l = readlink($fd) // next;
            return $pid if $l eq "socket:[$inode]";
        }
    }
    return undef;
}

# a raw request that stands in the queue, on the wanted worker (or any
# other than the unwanted one)
sub queued_on {
    my ($sid, %o) = @_;
    for (1 .. 40) {
        my $s = $t->raw_open('POST', $o{path} // '/v1/chat/completions',
                             chat_of($sid),
                             headers => { 'X-Session-Id' => $sid });
        my $w;
        $t->wait_for(sub { $w = worker_of($s) }, 5);
        if ($w && (!$o{on} || $w == $o{on}) && (!$o{not} || $w != $o{not})) {
            return ($s, $w);
        }
        close $s;
        sleep 0.05;    # a pause between tries, nothing awaited
    }
    return;
}

sub read_response {
    my ($s, $timeout) = @_;
    my $buf = '';
    my $end = time + $timeout;
    $s->blocking(0);
    while (time < $end) {
        my $n = sysread($s, my $chunk, 65536);
        if (defined $n && $n == 0) { last }
        $buf .= $chunk if $n;
        sleep 0.02 unless $n;
    }
    return $buf;
}

ask('warm');

# a waiter of the session swapped in dies in the middle of the queue
# only the holder's path is held, until the test lets it go: placing the
# waiters on their workers takes as long as it takes
my $release = $t->dir . '/release-holder';
$t->fake_script({ completion => { until => $release,
                                  path => '/v1/completions' } });
my ($holder, $wh) = queued_on('holder', path => '/v1/completions');
ok($t->wait_for(sub {
       my $c = $t->get('/api/sessions/current')->{json};
       $c->{slots}[0]{busy} && ($c->{slots}[0]{session}{id} // '') eq 'holder'
   }, 10), "the holder has the slot, on worker $wh");
my ($y, $wy) = queued_on('tee', on => $wh);
ok($y, "a request of session tee waits on worker $wy");
my ($z, $wz) = queued_on('tee', not => $wh);
ok($z, "another of tee waits on worker $wz");
my ($u, $wu) = queued_on('you', on => $wh);
ok($u, "a request of session you waits behind them on worker $wu");
my $cur;
ok($t->wait_for(sub { $cur = $t->get('/api/sessions/current')->{json};
                      ($cur->{waiting} // 0) >= 3 }, 15),
   'the three wait in the zone\'s queue') or diag $JSON->encode($cur);
kill 'KILL', $wz;
open my $rel, '>', $release or die "$release: $!";
close $rel;
like(read_response($holder, 30), qr/^HTTP\/1\.1 200/, 'the holder finished');
my $done = time;
like(read_response($y, 10), qr/^HTTP\/1\.1 200/, 'tee was served');
my $ru = read_response($u, 10);
my $after = time - $done;
like($ru, qr/^HTTP\/1\.1 200/,
     'you was served, not left behind the dead worker\'s waiter');
cmp_ok($after, '<', $ENV{TEST_NGINX_VALGRIND} ? 3 : 1.5,
       sprintf('%.2f s after the holder (the previous main: 3.7 s and more)', $after));
ok($t->log_lines(qr/dropping a waiter of dead worker $wz/),
   'the dead worker\'s waiter was dropped');
$t->fake_script({});

# the worker holding the slot dies during a restore
ask('alpha', 'alpha text');
ask('beta', 'beta text');                       # alpha saved
$t->fake_script({ restore => { delay_ms => 1500 } });
my ($s, $ws) = queued_on('alpha');
ok($s, "alpha's restore runs on worker $ws");
ok($t->wait_for(sub { grep { $_->{query} eq 'action=restore' }
                      @{ $t->fake_calls } }, 5), 'the restore started');
kill 'KILL', $ws;
# the restore the dead worker asked for ends in the backend: the slot
# holds alpha's file then
$t->wait_for(sub { $t->read_file('fake.state') =~ /alpha text/ }, 10)
    or diag 'the restore never ended in the backend';
$t->fake_script({});
my $r = ask('beta', 'beta text 2');
is($r->{status}, 200, 'beta is served after the holder died');
isnt($r->{headers}{'x-s-action'}, 'hit',
     'beta is no hit on a slot that held alpha\'s restore');
ok($t->log_lines(qr/died holding slot 0, its content is unknown/),
   'the dead holder is logged');
is(ask('alpha', 'alpha text 2')->{headers}{'x-s-action'}, 'restore',
   'alpha is restored from its file');

$t->stop;
done_testing;
