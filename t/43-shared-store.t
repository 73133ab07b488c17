#!/usr/bin/perl

# One store for the owners of one model (shared=on): three llama-servers
# of one model write one folder, three owner zones, a front that routes
# each session by "hash $llama_session_key consistent" (docs/scaling.md).
# No session loses its cache when the fleet changes:
# - an owner's llama-server goes down: its sessions go to the others, and
#   their next turns restore the files it saved (with a folder per
#   llama-server, as before, they start fresh: 0 cached of ~700 tokens);
# - it comes back: they return and restore the state saved elsewhere;
# - an owner is taken out of the front (its llama-server keeps running,
#   its slot the session it held): its sessions restore elsewhere, and
#   when it is back in, the one its slot still holds restores the newer
#   file instead of the slot's older state;
# - a fourth owner is added: the sessions the ring gives it restore there.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
my $dir = $t->dir;
for my $b (qw(a b c)) {
    $t->llama(name => $b, ctx => 8192, slots => "$dir/slots");
}

my @owners = qw(a b c);
my %front = (store => sub { "$dir/slots" }, zone => ' shared=on save_idle=1s',
             fail => '3s');
$t->nginx($t->owners(names => \@owners, %front));

# a new configuration: nginx reloads, its zones' shared memory stays
sub reload {
    my (%o) = @_;
    $t->nginx($t->owners(names => \@owners, %front, %o), write_only => 1);
    $t->reload;
    sleep 2;
}

my (%backend, %prev);

sub turn {
    my ($sid) = @_;
    my $r = $t->chat_turn($sid);
    die "$sid: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    return $r;
}

# turns of sessions that moved: restores of (nearly) all their tokens, and
# with "more", of the last turn's prompt at least (served elsewhere)
sub moved_turns {
    my ($sessions, %o) = @_;
    my @bad;
    for my $sid (@$sessions) {
        my $r = turn($sid);
        push @bad, "$sid on $r->{backend}, not $o{on}"
            if $o{on} && $r->{backend} ne $o{on};
        push @bad, "$sid still on $o{not}"
            if $o{not} && $r->{backend} eq $o{not};
        push @bad, "$sid on $r->{backend}: $r->{action}, $r->{cached} cached "
                   . "of $r->{prompt} (it had $prev{$sid})"
            if $r->{action} ne 'restore' || $r->{cached} < 0.9 * $r->{prompt}
               || ($o{more} && $r->{cached} < $prev{$sid});
        $backend{$sid} = $r->{backend};
        $prev{$sid} = $r->{prompt};
    }
    return @bad;
}

my @sessions = map { "m$_" } 1 .. 16;
for my $round (0 .. 1) {
    for my $sid (@sessions) {
        my $r = turn($sid);
        $backend{$sid} = $r->{backend};
        $prev{$sid} = $r->{prompt};
    }
}
my %load;
$load{$_}++ for values %backend;
# the ring's share of each owner depends on its port: two at least
cmp_ok(scalar keys %load, '>=', 2, 'spread over the owners ('
       . join(', ', map { "$_: $load{$_}" } sort keys %load) . ')');

# the session in each slot is saved too, once idle
sleep 3;

my ($gone) = sort { $load{$b} <=> $load{$a} } keys %load;
my @its = grep { $backend{$_} eq $gone } @sessions;
$t->stop_llama($gone);

my @bad = moved_turns(\@its, not => $gone);
is_deeply(\@bad, [], "llama-server $gone down: its " . @its . ' sessions '
          . 'restore their files on the other owners') or diag join "\n", @bad;

# the owner comes back (a new llama-server on its port): its sessions
# return to it and restore the state they saved on the others, with the
# turn served there
sleep 3;
$t->llama(name => $gone, ctx => 8192, slots => "$dir/slots",
          port => $t->{llama_port}{$gone});
sleep 4;
@bad = moved_turns(\@its, on => $gone, more => 1);
is_deeply(\@bad, [], "llama-server $gone back: its sessions return and "
          . 'restore the state saved on the other owners (more than they '
          . 'left)') or diag join "\n", @bad;
$t->allow_alerts(qr/connect\(\) failed/);

# the owner taken out of the front, its llama-server running: the last of
# its sessions stays in its slot while the others serve it
my $last = $its[-1];
sleep 3;
reload(down => { $gone => 1 });
@bad = moved_turns(\@its, not => $gone, more => 1);
is_deeply(\@bad, [], "$gone out of the front: its sessions restore on the "
          . 'others') or diag join "\n", @bad;

my $stale = () = $t->log_lines(qr/out its own older state/);
sleep 3;
reload();
@bad = moved_turns([ $last, grep { $_ ne $last } @its ], on => $gone,
                   more => 1);
is_deeply(\@bad, [], "$gone back in the front: its sessions restore the "
          . "state saved on the others, $last too, whose older state "
          . "the slot of $gone still held") or diag join "\n", @bad;
my $key = $t->chat_key($last);
ok(scalar $t->log_lines(qr/swap on slot 0 of zone "$gone": out its own older state \(another owner saved a newer one since\), in "\Q$key\E" restored/),
   "$gone\'s swap line says its slot held an older state of $last");

# a fourth owner: the ring gives it some sessions, which restore there
sleep 3;
$t->llama(name => 'd', ctx => 8192, slots => "$dir/slots");
push @owners, 'd';
reload();
my @to_d;
for my $try (1 .. 3) {
    @bad = ();
    for my $sid (@sessions) {
        my $was = $backend{$sid};
        my $r = turn($sid);
        if ($r->{backend} eq 'd') {
            push @to_d, $sid;
            push @bad, "$sid on d: $r->{action}, $r->{cached} cached of "
                       . "$r->{prompt} (it had $prev{$sid} on $was)"
                if $r->{action} ne 'restore'
                   || $r->{cached} < 0.9 * $r->{prompt}
                   || $r->{cached} < $prev{$sid};
        } elsif ($r->{backend} ne $was && $was ne 'd') {
            # (from d on its former port: where the ring puts it now)
            push @bad, "$sid moved from $was to $r->{backend}, not to d";
        }
        $backend{$sid} = $r->{backend};
        $prev{$sid} = $r->{prompt};
    }
    last if @to_d;
    # d's share of the ring depends on its port (about 1 in 100 ports
    # gives it none of 16 sessions): d on another port
    diag "the ring gave d no session on port $t->{owner_port}{d}";
    delete $t->{owner_port}{d};
    reload();
}
cmp_ok(scalar @to_d, '>=', 1, 'the ring gives d ' . @to_d . ' sessions');
is_deeply(\@bad, [], 'they restore on d, the others stay')
    or diag join "\n", @bad;

$t->stop;
done_testing;
