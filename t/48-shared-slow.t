#!/usr/bin/perl

# One store, two owners (shared=on), a front with "hash ... consistent" and
# proxy_next_upstream (docs/scaling.md), on the fake backend: the shared
# file system slow, a save runs past the slots location's
# proxy_read_timeout.  The owner answers 502 before anything ran, the
# front sends the request to the other owner, which answers it; the
# session whose save timed out keeps its previous file, whole, and its
# next turn restores it (re-prefilling the turns since).  And a stale hit
# whose newer file would cost more to read than its prompt to prefill
# stays a hit.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
my $dir = $t->dir;
$t->fake(name => $_, slots => "$dir/slots") for qw(a b);
$t->nginx($t->owners(names => [qw(a b)], store => sub { "$dir/slots" },
                     zone => ' shared=on save_idle=2s',
                     slots => 'proxy_read_timeout 1s;',
                     extra => sub { 'location = /metrics { '
                                    . 'llama_session_metrics; }' }));

# a conversation's turn n: its first message, then n - 1 exchanges
my $chat = sub {
    my ($sid, $n) = @_;
    return { messages => [ { role => 'user', content => "Hello from $sid" },
                           map { ({ role => 'assistant', content => "ok $_" },
                                  { role => 'user', content => "more $_" }) }
                               1 .. $n - 1 ] };
};

sub turn {
    my ($sid, $n) = @_;
    my $r = $t->post('/v1/chat/completions', $chat->($sid, $n),
                     headers => { 'X-Session-Id' => $sid });
    return { status => $r->{status}, action => $r->{headers}{'x-s-action'},
             backend => $r->{headers}{'x-backend'} };
}

my $r = turn('s', 1);
is($r->{status}, 200, 's on its owner');
my $owner = $r->{backend};
my $other = $owner eq 'a' ? 'b' : 'a';
my $key = LlamaTest::session_key('s', body => $chat->('s', 1));
ok($t->wait_for(sub { glob "$dir/slots/$key.*.bin" }, 15),
   "$owner saves s once idle");
my ($bin) = glob "$dir/slots/$key.*.bin";
my @before = (stat $bin)[1, 7, 9];
is(turn('s', 2)->{action}, 'hit', 's again on its owner: changed since');

# the store slow: the owner's next save takes 3 s, its bound is 1 s; the
# sessions below come at once, before the owner's idle save of s (2 s) could
# take the slot first and its own slow save answer the swap's question
$t->fake_script({ save => { delay_ms => 3000 } }, $owner);
my ($u, $got);
for my $i (1 .. 40) {
    my $r = turn("u$i", 1);
    next unless $r->{status} != 200 || $r->{backend} ne $other
                || $t->log_lines(qr/did not answer|\(save\) in time|timed out/);
    ($u, $got) = ("u$i", $r);
    last;
}
ok($u, 'a session the ring gives the slow owner (' . ($u // 'none') . ')');
is($got->{status}, 200, "$u answered, by the other owner")
    or diag explain $got;
is($got->{backend}, $other, "$u served by $other");
ok(scalar $t->log_lines(qr/upstream timed out .*_llama_slots|did not answer a slot call \(save\) in time/),
   'the slow save is logged');
is_deeply([ (stat $bin)[1, 7, 9] ], \@before, "s's previous file is intact");

$t->fake_script({}, $owner);
sleep 3;
$r = turn('s', 3);
is($r->{status}, 200, 's answered on its owner again');
is($r->{action}, 'restore', 's restores its previous file');

# a slow disk on the stale hit's owner: a's slot still holds x's older
# turn, b saved a later one, but reading it would cost more than the
# prompt's prefill (cost.c): the slot's state is used, a hit

my %conv;
sub direct {
    my ($owner, $sid) = @_;
    my $c = $conv{$sid} //= [ { role => 'user',
                                content => "$sid " . ('history ' x 800) } ];
    push @$c, { role => 'user', content => 'more ' . scalar(@$c) };
    my $r = $t->post('/v1/chat/completions', { messages => $c },
                     headers => { 'X-Session-Id' => $sid },
                     port => $t->owner_port($owner));
    die "$sid on $owner: $r->{status}\n" unless $r->{status} == 200;
    push @$c, { role => 'assistant', content => 'ok' };
    return $r->{headers}{'x-s-action'};
}

direct('a', $_) for qw(p q r);
$t->fake_script({ restore => { restore_ms => 60000 } }, 'a');
direct('a', $_) for qw(p q p q);
ok(scalar $t->log_lines(qr/swap on slot 0 of zone "a".* fresh \(re-prefilled/),
   'a has learnt that a restore costs more than a prefill');
direct('a', 'x');
direct('b', 'x');
my $xkey = LlamaTest::session_key('x', body => { messages =>
                                                 [ $conv{x}[0] ] });
ok($t->wait_for(sub { $t->log_lines(qr/idle save of "\Q$xkey\E"/) }, 10),
   'b saves x once idle');
my $reprefills = sub {
    my $m = $t->get('/metrics', port => $t->owner_port('a'))->{content};
    return $m =~ /^nginx_llama_session_reprefills_total\{zone="a"\} (\d+)$/m
           ? $1 : 'none';
};
my $n = $reprefills->();
ok($n =~ /^\d+$/ && $n > 0, "a counted its re-prefills ($n)");
is(direct('a', 'x'), 'hit', 'x back on a: its slot\'s older state, not a '
   . 're-prefill');
is($reprefills->(), $n, 'nor counted as one (reprefills_total ' . $n . ')');
$t->allow_alerts(qr/upstream timed out/);

$t->stop;
done_testing;
