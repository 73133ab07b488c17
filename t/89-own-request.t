#!/usr/bin/perl

# The idle saver's own request (no client behind it) through the ends a
# client's request can meet: nginx reloads, or shuts down, while its save
# runs in llama-server; the save answers late, or fails.  Against the fake
# backend, whose saves can be slowed down or made to fail.  The old worker
# finishes the save (the file is there, whole), exits, and nothing alerts;
# a failed save keeps the previous file and is tried again (the back-off
# itself is t/30's).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
$t->fake;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% '
            . 'save_idle=300ms;',
    location => 'proxy_read_timeout 30s;',
    slots => 'proxy_read_timeout 30s;'));

my $slots = $t->dir . '/slots';

sub turn {
    my ($sid, $text) = @_;
    my $r = $t->post('/v1/chat/completions', LlamaTest::conversation($text),
                     headers => { 'X-Session-Id' => $sid });
    die "$sid: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    return $r;
}

sub idle_saves {
    return grep { ($_->{query} // '') eq 'action=save'
                  && ($_->{headers}{'user-agent'} // '')
                     =~ /nginx-llama-session \(idle save\)/ }
           @{ $t->fake_calls };
}

# a reload while the idle save runs: the old worker waits for it
$t->fake_script({ save => { delay_ms => 2500 } });
turn('ann', 'ann wrote this');
ok($t->wait_for(sub { idle_saves() >= 1 }, 10),
   'the idle save of ann reached llama-server');
$t->reload;
ok($t->wait_for(sub { $t->log_lines(qr/idle save of "ann-\w+" from slot 0 of zone "llama": \d+ tokens/) }, 15),
   'the old worker finished it after the reload');
my ($file) = glob "$slots/ann-*.bin";
ok($file && $t->read_file($file) =~ /ann wrote this/,
   'its file is in the store, with the turn');
# (under valgrind a worker's exit code is valgrind's: the harness reads
# valgrind's own logs instead)
ok($t->wait_for(sub { $t->log_lines(qr/worker process \d+ exited with code \d+/) >= 2 },
                $ENV{TEST_NGINX_VALGRIND} ? 60 : 15),
   'the old workers exited');
ok(!$t->log_lines(qr/exited on signal/), 'none of them crashed');
ok(!$t->log_lines(qr/worker process \d+ exited with code [1-9]/)
   || $ENV{TEST_NGINX_VALGRIND}, 'both with code 0');
ok(!glob("$slots/*.tmp"), 'no temporary file stays');
$t->fake_script({});

# a failed idle save: the previous file stays, and it is tried again later
my $whole = $t->read_file($file);
turn('ann', 'ann wrote more');
$t->fake_script({ save => { status => 500, message => 'Unable to save slot' } });
my $n = idle_saves();
ok($t->wait_for(sub { $t->log_lines(qr/idle save: saving session "ann-\w+" from slot 0 failed \(500/) }, 10),
   'the failed idle save is logged');
is($t->read_file($file), $whole, 'ann\'s previous file is whole');
ok(!glob("$slots/*.tmp"), 'no temporary file of the failed save');
$t->fake_script({});
ok($t->wait_for(sub { $t->read_file($file) =~ /ann wrote more/ }, 15),
   'the next try saved the latest turn');

# a shutdown while an idle save runs: the worker finishes it first
$t->fake_script({ save => { delay_ms => 1500 } });
turn('bea', 'bea asks');
ok($t->wait_for(sub { grep { ($_->{body} // '') =~ /bea-/ } idle_saves() },
                10), 'the idle save of bea reached llama-server');
$t->stop_nginx;
ok(glob("$slots/bea-*.bin"), 'nginx stopped after bea\'s save, its file is there');
ok(!glob("$slots/*.tmp"), 'and no temporary file');

$t->stop;
done_testing;
