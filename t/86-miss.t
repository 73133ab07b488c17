#!/usr/bin/perl

# Why a prompt missed the cache (fake backend: its cache is the common
# prefix of the prompt's text, as llama-server's is of the tokens): a
# client that rewrites an earlier message loses most of the cache, and the
# error log says at info where the prompt first differs from the session's
# previous one, from the slot's copy (a hit) or from the session's .json (a
# restore).  A prompt that only grows is no miss.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
$t->fake(np => 1);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    location => 'add_header X-S-Action $llama_session_action always;'));

sub send_msgs {
    my ($sid, $msgs) = @_;
    my $r = $t->post('/v1/chat/completions', { messages => $msgs, max_tokens => 4 },
                     headers => { 'X-Session-Id' => $sid });
    die "$r->{status} $r->{content}" unless $r->{status} == 200;
    return $r;
}

my $long = join ' ', map { "Fact $_ of the tool result." } 1 .. 80;   # ~2 KB
my @a = ({ role => 'user', content => 'Please read the tool result. ' . 'x' x 300 });
send_msgs('a', \@a);
push @a, { role => 'assistant', content => $long },
         { role => 'user', content => 'Thanks. Next?' };
my $r = send_msgs('a', \@a);
is($r->{headers}{'x-s-action'}, 'hit', 'a grows: a hit');
push @a, { role => 'assistant', content => 'ok' },
         { role => 'user', content => 'And then?' };
send_msgs('a', \@a);
ok(!$t->log_lines(qr/missed the cache/), 'a prompt that only grows is no miss');

# the client trims message 2 (the tool result) from its start

my @b = @a;
$b[1] = { role => 'assistant', content => 'Fact trimmed.' . substr($long, 40) };
$r = send_msgs('a', \@b);
is($r->{headers}{'x-s-action'}, 'hit', 'a with message 2 rewritten: still its session');
ok($r->{json}{timings}{cache_n} * 2 < $r->{json}{usage}{prompt_tokens},
   "most of the cache is lost: $r->{json}{timings}{cache_n} of $r->{json}{usage}{prompt_tokens}");
my ($line) = $t->log_lines(qr/session "a-\w+" missed the cache/);
ok($line, 'the error log says the session missed the cache') or diag $t->read_file('error.log');
like($line // '', qr/5 messages, the previous prompt had 5: the first 1 are the same, message 2 \(assistant\) differs in its first 64 bytes/,
     'and where: message 2, in its first bytes');

# a change further in, found from the session's .json after a restore

my @c = @b;
push @c, { role => 'assistant', content => 'ok' }, { role => 'user', content => 'Go on.' };
send_msgs('a', \@c);
send_msgs('other', [ { role => 'user', content => 'Another session.' } ]);
ok(-e $_, 'a was saved') for glob($t->dir . '/slots/a-*.json');
like($t->read_file((glob($t->dir . '/slots/a-*.json'))[0]), qr/"msgs":"[A-Za-z0-9+\/=]+","prompt_tokens":\d+/,
     'its .json keeps its last prompt in a few bytes per message');

my @d = @c;
substr(my $edited = $d[1]{content}, 700, 5) = 'EDIT!';
$d[1] = { role => 'assistant', content => $edited };
$r = send_msgs('a', \@d);
is($r->{headers}{'x-s-action'}, 'restore', 'a returns, restored');
my @lines = $t->log_lines(qr/session "a-\w+" missed the cache/);
is(scalar @lines, 2, 'a second miss is logged');
like($lines[-1], qr/7 messages, the previous prompt had 7: the first 1 are the same, message 2 \(assistant\) is the same for its first 512 of \d+ bytes \(was \d+\)/,
     'where, from the .json: message 2, the same for its first 512 bytes');

$t->stop;
done_testing;
