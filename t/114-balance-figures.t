#!/usr/bin/perl

# llama_session_balance (issue 45) by its figures, make bench's balance
# part in small on one seed: four owners of two slots over one store
# (shared=on), the fake backend spending a turn's time (a base and the
# prefill of what its slot did not hold), four hot sessions (long, short
# thinks; three of one home on nginx's ring: the hash's worst case) and
# eight cold ones, the same schedule and owner addresses on every side:
# hash consistent, least_conn, the balancer.  The balancer must:
#
#   - hit at least 0.9x the hash's returning turns and twice least_conn's;
#   - keep the busiest owner's turns in flight within 1.35x the mean;
#   - re-prefill no returning turn (each one's cache from its slot or its
#     file);
#   - with the owner of the three down, send its sessions to more than one
#     other owner, each restored from its file, every turn 200.
#
# The figures on llama-server and a real store: docs/benchmarks.md 14.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use JSON::PP;
use LlamaBalance;
use LlamaTest;
use POSIX ();
use Test::More;
use Time::HiRes qw(sleep time);

my @names = qw(a b c d);
my %port = map { $_ => LlamaTest::port() } @names;
my $ring = LlamaTest::chash_ring(%port);

sub home { LlamaTest::chash_home($ring, LlamaTest::first_key($_[0])) }

# the sessions: three hot ones of one home, a fourth of another, eight cold
my (%by, @hot);
for (my $i = 0; @hot < 3; $i++) {
    my $list = $by{ home("h$i") } //= [];
    push @$list, "h$i";
    @hot = @$list if @$list == 3;
}
my $crowded = home($hot[0]);
for (my $i = 0; @hot < 4; $i++) {
    push @hot, "k$i" if home("k$i") ne $crowded;
}
my @cold = map { "c$_" } 1 .. 16;
diag("@hot[0 .. 2]: home $crowded; $hot[3]: home " . home($hot[3]));

# the schedule, one seed: thinks before each returning turn
srand(1);
my %thinks = ((map { $_ => [ map { 0.2 + rand 0.3 } 1 .. 12 ] } @hot),
              (map { $_ => [ map { 3 + rand 3 } 1 .. 2 ] } @cold));
my %notes = ((map { $_ => 150 } @hot), (map { $_ => 20 + int rand 30 } @cold));

my $json = JSON::PP->new->canonical;

# one side: its nginx front and owners, the sessions' first turns, then
# every session's returning turns from a process of its own.  Returns the
# returning turns ({sid, t0, t1, status, backend, action, prompt, cached})
# and the running side's LlamaTest
sub side {
    my ($balance) = @_;

    my $t = LlamaBalance::fleet(
        names => \@names, balance => $balance, ports => \%port,
        script => { prefill_us => 100, completion => { delay_ms => 60 },
                    restore => { delay_ms => 40, restore_ms => 40 } });
    my $dir = $t->dir;

    for my $sid (@hot, @cold) {
        my $r = $t->chat_turn($sid, notes => $notes{$sid});
        is($r->{status}, 200, "$balance: ${sid}'s first turn") or return;
    }
    sleep 0.5;    # the idle saves: every session has a file

    my %pid;
    for my $sid (@hot, @cold) {
        my $pid = fork // die "fork: $!";
        if ($pid) {
            $pid{$pid} = $sid;
            next;
        }
        open my $fh, '>', "$dir/turns.$sid" or POSIX::_exit(1);
        for my $think (@{ $thinks{$sid} }) {
            sleep $think;
            my $t0 = time;
            my $r = $t->chat_turn($sid);
            print $fh $json->encode({ sid => $sid, t0 => $t0, t1 => time,
                                      map { $_ => $r->{$_} }
                                      qw(status backend action prompt
                                         cached) }), "\n";
        }
        # the conversation as it stands, for the turns after the run
        print $fh $json->encode({ conv => $t->{conv}{$sid} }), "\n";
        close $fh;
        POSIX::_exit(0);    # not the test's END: its nginx stays up
    }
    waitpid($_, 0) for keys %pid;

    my @turns;
    for my $sid (@hot, @cold) {
        open my $fh, '<', "$dir/turns.$sid" or die "$sid: $!";
        for (map { $json->decode($_) } <$fh>) {
            if ($_->{conv}) {
                $t->{conv}{$sid} = $_->{conv};
            } else {
                push @turns, $_;
            }
        }
    }
    return (\@turns, $t);
}

# the figures of a side's returning turns
sub figures {
    my ($turns) = @_;
    my ($lo, $hi) = (1e12, 0);
    for (@$turns) {
        $lo = $_->{t0} if $_->{t0} < $lo;
        $hi = $_->{t1} if $_->{t1} > $hi;
    }

    # turns in flight per owner, sampled every 10 ms over the run
    my %sum = map { $_ => 0 } @names;
    for (my $at = $lo; $at < $hi; $at += 0.01) {
        for (@$turns) {
            $sum{ $_->{backend} }++
                if $_->{t0} <= $at && $at < $_->{t1} && $_->{backend};
        }
    }
    my ($max, $all) = (0, 0);
    for (values %sum) {
        $max = $_ if $_ > $max;
        $all += $_;
    }

    my $n = @$turns;
    return { turns => $n,
             ok => scalar(grep { $_->{status} == 200 } @$turns),
             hits => scalar(grep { ($_->{action} // '') eq 'hit' } @$turns),
             redone => scalar(grep { $_->{status} == 200
                                     && $_->{cached} < 0.9 * $_->{prompt} }
                              @$turns),
             busiest => $all ? $max / ($all / @names) : 0,
             spread => join('/', map { $sum{$_} } @names) };
}

my (%f, $t, %last);
for my $side (['hash', 'hash $llama_session_key consistent'],
              ['least_conn', 'least_conn'],
              ['balance', 'llama_session_balance'])
{
    my ($turns, $st) = side($side->[1]);
    BAIL_OUT("$side->[0]: a first turn failed") unless $turns;
    $f{ $side->[0] } = figures($turns);
    diag(sprintf('%-10s hits %2d of %d, busiest/mean in flight %.2f (%s), '
                 . 're-prefilled %d', $side->[0],
                 @{ $f{ $side->[0] } }{qw(hits turns busiest spread redone)}));
    is($f{ $side->[0] }{ok}, $f{ $side->[0] }{turns},
       "$side->[0]: every returning turn 200");
    if ($side->[0] eq 'balance') {
        $t = $st;
        # where each session's last turn ran; the hot ones' turns, by
        # owner and kind (h: hit, r: restore)
        my %trace;
        for (sort { $a->{t1} <=> $b->{t1} } @$turns) {
            $last{ $_->{sid} } = $_->{backend};
            $trace{ $_->{sid} } .= ' ' . ($_->{backend} // '?')
                                   . substr($_->{action} // '?', 0, 1);
        }
        diag("$_:$trace{$_}") for @hot;
    } else {
        $st->stop;
    }
}

my ($b, $h, $l) = @f{qw(balance hash least_conn)};
ok($b->{hits} >= 0.9 * $h->{hits},
   "the balancer's hits ($b->{hits}) at least 0.9x the hash's ($h->{hits})");
ok($b->{hits} >= 2 * $l->{hits},
   "the balancer's hits ($b->{hits}) at least 2x least_conn's ($l->{hits})");
ok($b->{busiest} <= 1.35,
   sprintf('the balancer: busiest/mean in flight %.2f, at most 1.35 '
           . '(the hash: %.2f)', $b->{busiest}, $h->{busiest}));
ok($h->{busiest} > 1.35,
   sprintf('the hash crowds one owner (%.2f): the schedule tells them '
           . 'apart', $h->{busiest}));
is($b->{redone}, 0, 'the balancer re-prefilled no returning turn');

# the fault: the owner of the three hot sessions' home down, the sessions
# it last ran restore elsewhere, on more than one other owner
sleep 0.5;    # the idle saves
my @its = grep { ($last{$_} // '') eq $crowded } @hot, @cold;
ok(@its > 1, "$crowded ran @its last");
$t->stop_proc($crowded);

my %went;
for my $sid (@hot, @cold) {
    my $r = $t->chat_turn($sid);
    is($r->{status}, 200, "$crowded down: ${sid}'s turn 200");
    next unless $r->{status} == 200;
    isnt($r->{backend}, $crowded, "$sid: not on $crowded");
    ok($r->{cached} >= 0.9 * $r->{prompt},
       "$sid: $r->{cached} of $r->{prompt} cached ($r->{action} on "
       . "$r->{backend})");
    $went{ $r->{backend} }++ if grep { $_ eq $sid } @its;
}
ok(keys %went > 1, "${crowded}'s sessions spread: "
                   . join(', ', map { "$_ $went{$_}" } sort keys %went));

$t->stop;
done_testing;
