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
$t->nginx(<<'EOF');
    llama_session_zone zone=llama:1m store=%%SLOTS%%;

    upstream llama { server 127.0.0.1:%%LLAMA%%; }

    server {
        listen 127.0.0.1:%%PORT%%;

        add_header X-S-Action $llama_session_action always;
        add_header X-S-Wait $llama_session_wait_ms always;

        location / {
            llama_session llama;
            llama_session_wait_timeout 8s;
            proxy_pass http://llama;
        }

        location /_llama_slots/ {
            internal;
            proxy_pass http://llama/;
        }
    }
EOF

$t->allow_alerts(qr/worker process \d+ exited on signal 9/,
                 qr/died holding slot/);

sub chat_of { { messages => [ { role => 'user', content => $_[0] } ] } }

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
            next unless @c > 9 && $c[2] =~ /:$port$/;
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
        my $s = $t->raw_open('POST', '/v1/chat/completions', chat_of($sid),
                             headers => { 'X-Session-Id' => $sid });
        my $w;
        $t->wait_for(sub { $w = worker_of($s) }, 2);
        if ($w && (!$o{on} || $w == $o{on}) && (!$o{not} || $w != $o{not})) {
            return ($s, $w);
        }
        close $s;
        sleep 0.05;
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
$t->fake_script({ completion => { delay_ms => 1200 } });
my $holder = $t->async_post('/v1/chat/completions', chat_of('holder'),
                            headers => { 'X-Session-Id' => 'holder' });
sleep 0.3;
my ($y, $wy) = queued_on('tee');
ok($y, "a request of session tee waits on worker $wy");
my ($z, $wz) = queued_on('tee', not => $wy);
ok($z, "another of tee waits on worker $wz");
my ($u, $wu) = queued_on('you', on => $wy);
ok($u, "a request of session you waits behind them on worker $wu");
$t->fake_script({ completion => { delay_ms => 300 } });
kill 'KILL', $wz;
my $t0 = time;
is($t->async_wait($holder)->{status}, 200, 'the holder finished');
like(read_response($y, 10), qr/^HTTP\/1\.1 200/, 'tee was served');
my $ru = read_response($u, 10);
like($ru, qr/^HTTP\/1\.1 200/,
     'you was served, not left behind the dead worker\'s waiter');
my ($wait) = $ru =~ /X-S-Wait: (\d+)/i;
cmp_ok($wait // 1e9, '<', 3000,
       "after ${\($wait // '?')} ms (the previous main: 4.9 s)");
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
sleep 2;
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
