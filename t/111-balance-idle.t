#!/usr/bin/perl

# llama_session_balance (issue 45): where a session that must restore
# goes when owners are as soon.  Two owners of two slots over one store,
# both idle: a session with a file and no slot costs the same restore on
# either.  Its home's slots hold two sessions that have just talked; the
# other owner has a slot free.  The turn goes where it displaces nobody
# (nginx's ring alone would send it home, to push out a session that
# still talks), and the two at home stay hits.  Then, with no slot free
# anywhere, it goes where the slot to give up has been idle longest; and
# where a session talks it does not go, a slot free there or not.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaBalance;
use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep);

my @names = qw(a b);
my $t = LlamaBalance::fleet(names => \@names);

my $ring = LlamaTest::chash_ring(map { $_ => $t->owner_port($_) } @names);
sub home { LlamaTest::chash_home($ring, LlamaTest::first_key($_[0])) }

# new sessions of one home
sub new_of { LlamaBalance::new_of(\&home, $_[0], 'n') }

sub turn {
    my ($sid, $why) = @_;
    my $r = $t->chat_turn($sid);
    is($r->{status}, 200, "$sid: $why");
    sleep 0.4;    # its idle save done: the owner idle again
    return $r;
}

# x: its first turn at home, then pushed out of its slots there by two
# new sessions of that home

my $home = 'a';
my $other = 'b';
my $x = new_of($home);
my ($y1, $y2) = (new_of($home), new_of($home));
is(turn($x, 'first turn')->{backend}, $home, "$x: home $home");
is(turn($y1, 'first turn')->{backend}, $home, "$y1: home $home");
is(turn($y2, 'first turn')->{backend}, $home, "$y2: home $home");
is(turn($y1, 'again')->{action}, 'hit', "$y1: in its slot at $home");

# 1. a slot free on the other owner: x restores there, not at home

my $r = turn($x, 'back, with a file and no slot');
is($r->{backend}, $other, "$x: restored where a slot is free ($other), "
                          . "not at home");
is($r->{action}, 'restore', "$x: restored");
ok(($r->{cached} // 0) > 0.9 * ($r->{prompt} // 1e9),
   "$x: $r->{cached} of $r->{prompt} cached");
is(turn($y1, 'again')->{action}, 'hit', "$y1: still in its slot at $home");
is(turn($y2, 'again')->{action}, 'hit', "$y2: still in its slot at $home");

# 2. no slot free: w, of home a, placed on b straight through b's own
# location, then pushed out of b by z there after x talked; the two at
# home talk last, b's slots stay quiet: w goes to b, whose slot to give up
# has been idle longest, not home

my $w = new_of($home);
my $q = $t->chat_turn($w, owner => $other);
is($q->{status}, 200, "$w: first turn, straight to $other");
sleep 0.4;
is(turn($x, 'again')->{action}, 'hit', "$x: a hit on $other");
my $z = new_of($other);
$q = $t->chat_turn($z, owner => $other);
is($q->{status}, 200, "$z: first turn, straight to $other: $w out");
sleep 1.5;    # x and z quiet on b
is(turn($y1, 'again')->{action}, 'hit', "$y1: a hit at $home");
is(turn($y2, 'again')->{action}, 'hit', "$y2: a hit at $home");
$r = turn($w, 'back, with a file and no slot');
is($r->{backend}, $other, "$w (home $home): restored on $other, whose "
                          . 'slot to give up was idle longest');
is($r->{action}, 'restore', "$w: restored");
is(turn($y1, 'again')->{action}, 'hit', "$y1: still a hit at $home");
is(turn($y2, 'again')->{action}, 'hit', "$y2: still a hit at $home");

$t->stop;

# 3. an owner that runs a session that talks is not where a turn that
# must restore goes, a slot free there or not: the owner quiet longest
# is.  Home a holds y1 and y2, quiet; b holds q, which has just talked,
# and a slot free.  x (home a, with a file) restores at home, giving up a
# slot of a quiet session, and the talking q keeps b to itself (the
# sessions that talk spread over the owners, and with them the work)

$t = LlamaBalance::fleet(names => \@names);
$ring = LlamaTest::chash_ring(map { $_ => $t->owner_port($_) } @names);

$x = LlamaBalance::new_of(\&home, $home, 'p');
($y1, $y2) = map { LlamaBalance::new_of(\&home, $home, 'p') } 1 .. 2;
my $qb = LlamaBalance::new_of(\&home, $other, 'p');
is(turn($x, 'first turn')->{backend}, $home, "$x: home $home");
is(turn($y1, 'first turn')->{backend}, $home, "$y1: home $home");
is(turn($y2, 'first turn')->{backend}, $home, "$y2: home $home, $x out");
is(turn($qb, 'first turn')->{backend}, $other, "$qb: home $other");
sleep 1.5;    # both owners quiet
$r = $t->chat_turn($qb);
is($r->{action}, 'hit', "$qb talks: a hit on $other");
$r = $t->chat_turn($x);
is($r->{backend}, $home, "$x: restored at home, where no session talks, "
                         . "not beside $qb on ${other}'s free slot");
is($r->{action}, 'restore', "$x: restored");
is(turn($qb, 'again')->{action}, 'hit', "$qb: still a hit on $other");

$t->stop;
done_testing;
