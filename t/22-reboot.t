#!/usr/bin/perl

# Sessions survive a reboot, against a real llama-server: A, then B, then
# llama-server and nginx stop and start again, and A's next turn is served
# from A's restored cache.  A session that never left the slot survives
# too, through the idle save.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
my $llama = $t->llama;

my $conf = $t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% save_idle=1s;',
    upstream => '',
    location => q{
        proxy_read_timeout 300s;
        add_header X-S-Action $llama_session_action always;
    });

$t->nginx($conf);

my $system = join ' ', map { "Clause $_ of the agreement applies." } 1 .. 120;

sub ask {
    my ($sid, $text) = @_;
    my $r = $t->post('/v1/chat/completions',
                     { messages => [ { role => 'system', content => $system },
                                     { role => 'user', content => $text } ],
                       max_tokens => 2, temperature => 0 },
                     headers => { 'X-Session-Id' => $sid });
    die "$sid: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    return ($r->{json}{usage}{prompt_tokens},
            $r->{json}{usage}{prompt_tokens_details}{cached_tokens},
            $r->{headers}{'x-s-action'});
}

my $a_text = join ' ', map { "Alice wrote note $_." } 1 .. 60;
my ($a_prompt) = ask('alice', $a_text);
ask('bob', 'Bob asks something else entirely.');
ok(glob($t->dir . '/slots/alice-*.bin'), 'alice was saved when bob came');

sub reboot {
    $t->stop_nginx;
    $t->stop_llama;
    $t->llama(port => $llama);
    $t->start_nginx;
}

reboot();
my ($prompt, $cached, $action) = ask('alice', $a_text);
is($action, 'restore', 'after the reboot alice is restored');
cmp_ok($cached, '>=', $a_prompt - 4,
       "alice's cache is back: $cached of $prompt tokens cached");
ok($t->log_lines(qr/llama_session zone "llama": 3 saved sessions/),
   "nginx indexed alice's file, the system prompt's base and bob's at start "
   . "(bob, still in the slot, was saved at the stop)");
ok($t->log_lines(qr/save at stop of "bob-/), 'bob was saved at the stop');

# carol never leaves the slot: the idle save keeps her
my $c_text = join ' ', map { "Carol keeps record $_." } 1 .. 60;
my ($c_prompt) = ask('carol', $c_text);
ok($t->wait_for(sub { $t->log_lines(qr/idle save of "carol-/) }, 15),
   'carol was saved while idle');
reboot();
($prompt, $cached, $action) = ask('carol', $c_text);
is($action, 'restore', 'after the next reboot carol is restored');
cmp_ok($cached, '>=', $c_prompt - 4,
       "carol's cache is back: $cached of $prompt tokens cached");

$t->stop;
done_testing;
