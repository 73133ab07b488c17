#!/usr/bin/perl

# A graceful stop of nginx (QUIT: nginx -s quit, systemctl stop) saves the
# sessions that changed since their last save, however long they were idle,
# against a real llama-server: after nginx starts again, the next turn is
# restored with every turn before the stop.  A reload saves nothing (its
# workers keep the slots), a stop whose saves fail still ends at once, and
# worker_shutdown_timeout bounds the saves.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;
use Time::HiRes qw(time);

my $t = LlamaTest->new(workers => 2);
my $llama = $t->llama;

# save_idle= long enough never to run here: only the stop saves
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% save_idle=600s;',
    http => 'llama_session_warm off;',
    location => q{
        proxy_read_timeout 300s;
        add_header X-S-Action $llama_session_action always;
    }));

my @history;

sub turn {
    my ($text) = @_;
    push @history, { role => 'user', content => $text };
    my $r = $t->post('/v1/chat/completions',
                     { messages => [ @history ], max_tokens => 2,
                       temperature => 0 },
                     headers => { 'X-Session-Id' => 'alice' });
    die "alice: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    push @history, { role => 'assistant',
                     content => $r->{json}{choices}[0]{message}{content} };
    return ($r->{json}{usage}{prompt_tokens},
            $r->{json}{usage}{prompt_tokens_details}{cached_tokens},
            $r->{headers}{'x-s-action'});
}

sub saves_at_stop {
    return scalar $t->log_lines(qr/save at stop of "alice-/);
}

sub files { my @f = glob($t->dir . '/slots/alice-*.bin'); return @f }

sub timed_stop {
    my $t0 = time;
    $t->stop_nginx;
    return time - $t0;
}

turn(join ' ', map { "Alice wrote note $_." } 1 .. 40);
my ($p2, undef, $a2) = turn(join ' ', map { "Then she added line $_." } 1 .. 40);
is($a2, 'hit', 'the second turn is a hit');
ok(!files(), 'nothing is saved before the stop');

my $took = timed_stop();
is(saves_at_stop(), 1, 'the stop saved alice, once (two workers)');
ok(files(), "alice's file is on disk");
cmp_ok($took, '<', 10, sprintf('nginx stopped in %.1f s', $took));

# llama-server kept its slot; nginx cannot vouch for it after a start
$t->start_nginx;
my ($p3, $c3, $a3) = turn('And one more thing.');
is($a3, 'restore', 'after the start alice is restored');
cmp_ok($c3, '>=', $p2 - 4, "with her turns up to the stop: $c3 cached "
       . "(the second turn's prompt: $p2 tokens)");

# a reload: the new workers go on with the slot, the old ones save nothing
my ($p4, undef, $a4) = turn('A fourth turn before the reload.');
is($a4, 'hit', 'a fourth turn is a hit');
my $exited = () = $t->read_file('error.log') =~ /exited with code/g;
$t->reload;
ok($t->wait_for(sub {
       (() = $t->read_file('error.log') =~ /exited with code/g) >= $exited + 2
   }, 10), 'the reload\'s old workers exited');
is(saves_at_stop(), 1, 'they saved nothing');
my ($p5, $c5, $a5) = turn('A fifth turn after the reload.');
is($a5, 'hit', 'the fifth turn is a hit on the slot the reload kept');
cmp_ok($c5, '>=', $p4 - 4, "$c5 cached");

# llama-server is gone at the stop: the save fails, nginx still stops
turn('A sixth turn, then llama-server goes.');
$t->stop_llama;
$took = timed_stop();
# (a worker's first look comes 1 to 2 s after its start, the next ones 1 s
# apart)
cmp_ok($took, '<', 8, sprintf('without llama-server nginx stopped in %.1f s',
                               $took));
ok(scalar $t->log_lines(qr/idle save: GET \/slots through .* answered/),
   'the failed GET /slots is logged');
is(saves_at_stop(), 1, 'and nothing was saved');

$t->stop;

# worker_shutdown_timeout bounds the saves at a stop: no save starts after
# it; the one under way ends, or nginx cuts it when it began before the
# timeout (the fake backend: saves of 6 s, two slots).  The worker's first
# look at its slots comes up to 1 s after the stop (its idle step): the
# timeout, 3 s, leaves it time on a busy machine, and the test waits for
# the save to reach the backend, not for a time.
my $f = LlamaTest->new(workers => 1);
$f->fake(np => 2);
$f->nginx($f->site(
    zone => 'llama_session_zone zone=llama:1m slots=2 store=%%SLOTS%% '
            . 'save_idle=600s;',
    http => 'llama_session_warm off;',
    location => 'proxy_read_timeout 30s;',
    slots => 'proxy_read_timeout 30s;'),
    main => 'worker_shutdown_timeout 3s;');
for my $sid (qw(dan eve)) {
    my $r = $f->post('/v1/chat/completions',
                     LlamaTest::conversation("$sid asks"),
                     headers => { 'X-Session-Id' => $sid });
    is($r->{status}, 200, "$sid: 200");
}
$f->fake_script({ save => { delay_ms => 6000 } });
my $saves = sub {
    grep { ($_->{query} // '') eq 'action=save' } @{ $f->fake_calls } };
my $t0 = time;
my $pid = $f->{pids}{nginx};
kill 'QUIT', $pid;
ok($f->wait_for(sub { $saves->() }, 10), 'a save at stop began');
$f->stop_nginx;
$took = time - $t0;
is(scalar(my @s = $saves->()), 1,
   'one save at stop began, of two changed sessions');
is(scalar($f->log_lines(qr/save at stop of "(dan|eve)-/))
   + scalar($f->log_lines(qr/nginx stops: a save failed/)), 1,
   'and ended, or was cut (logged)');
cmp_ok($took, '<', 14, sprintf('nginx stopped in %.1f s (up to 2 s to its '
                               . 'first look, 6 s of save)', $took));
ok(scalar $f->log_lines(qr/nginx stops: worker_shutdown_timeout passed, no more sessions are saved/),
   'then no save started, logged');
$f->stop;
done_testing;
