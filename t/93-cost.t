#!/usr/bin/perl

# When a restore pays (cost.c): the module learns the backend's prompt
# speed from the replies (timings.prompt_ms over prompt_n) and its restore
# speed from the restores (timings.restore_ms over the file's bytes), and
# re-prefills a session whose file would take clearly longer to read than
# its prompt to prefill.  The fake backend prefills at 0.5 ms a "token"
# (a character of its prompt) and reports what the script says a restore
# took: a fast disk, then a slow one, then a fast one again.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 1);
$t->fake;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    upstream => '',
    location => 'add_header X-S-Action $llama_session_action always;',
    extra => 'location = /metrics { llama_session_metrics; }'));

my %conv;
sub turn {
    my ($sid) = @_;
    my $c = $conv{$sid} //= [ { role => 'user',
                                content => "$sid " . ('history ' x 800) } ];
    push @$c, { role => 'user', content => 'more ' . scalar(@$c) };
    my $r = $t->post('/v1/chat/completions', { messages => $c },
                     headers => { 'X-Session-Id' => $sid });
    die "$sid: $r->{status}\n" unless $r->{status} == 200;
    push @$c, { role => 'assistant', content => 'ok' };
    return $r->{headers}{'x-s-action'};
}

# a fast disk: every returning turn is restored, and the rates are learnt
# (the prompt's from the first turns, which evaluate all of it)
turn('a'); turn('b'); turn('c');
my @fast = map { (turn('a'), turn('b')) } 1 .. 2;
is_deeply(\@fast, [ ('restore') x 4 ], 'a fast disk: restores');

# a slow one: a file of ~6.5 kB now takes 60 s, the prompt ~3.3 s
$t->fake_script({ restore => { restore_ms => 60000 } });
my @slow = map { (turn('a'), turn('b')) } 1 .. 2;
is($slow[0], 'restore', 'a slow restore is measured first');
ok((grep { $_ eq 'fresh' } @slow[1 .. 3]),
   'then sessions are re-prefilled instead: @slow');
ok($t->log_lines(qr/in "b-\w+" fresh \(re-prefilled: its file would take ~\d+ ms to restore, its prompt ~\d+ ms to prefill\)/),
   'the swap line says why');
my $m = $t->get('/metrics')->{content};
my $n = grep { $_ eq 'fresh' } @slow;
like($m, qr/^nginx_llama_session_reprefills_total\{zone="llama"\} $n$/m,
     "the metrics count them ($n)");

# the disk gets fast again: after some re-prefills one restore measures it
$t->fake_script({});
my @after = map { (turn('a'), turn('b')) } 1 .. 8;
ok((grep { $_ eq 'restore' } @after), 'a restore now and then measures '
   . 'the disk again: ' . join(' ', @after));
is($after[-1], 'restore', 'and restores come back once it is fast');

$t->stop;
done_testing;
