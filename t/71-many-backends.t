#!/usr/bin/perl

# Many llama-servers behind one nginx, with its stock pieces: a zone per
# llama-server, each in a server of its own (an owner), and a front server
# that routes each session by "hash $llama_session_key consistent" (the
# module in identity mode sets the key).  Against three real llama-servers:
# each session keeps its backend and its cache; a backend that goes down
# sends its sessions elsewhere (they start there), the others stay.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
my $dir = $t->dir;
for my $b (qw(a b c)) {
    $t->llama(name => $b, ctx => 8192, slots => "$dir/slots-$b");
}

$t->nginx($t->owners(names => [qw(a b c)],
                     store => sub { "$dir/slots-$_[0]" }));

my (%backend, %prev);

sub turn {
    my ($sid) = @_;
    my $r = $t->chat_turn($sid);
    die "$sid: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    return $r;
}

my @sessions = map { "m$_" } 1 .. 24;
my @bad;
for my $round (0 .. 2) {
    for my $sid (@sessions) {
        my $r = turn($sid);
        push @bad, "$sid moved from $backend{$sid} to $r->{backend}"
            if defined $backend{$sid} && $backend{$sid} ne $r->{backend};
        push @bad, "$sid: $r->{cached} cached of $prev{$sid}"
            if $round && $r->{cached} < $prev{$sid} - 4;
        $backend{$sid} = $r->{backend};
        $prev{$sid} = $r->{prompt};
    }
}
is_deeply(\@bad, [], '24 sessions, 3 rounds: each keeps its llama-server and '
          . 'finds its cache') or diag join "\n", @bad;
my %load;
$load{$_}++ for values %backend;
is(scalar keys %load, 3, 'spread over the three ('
   . join(', ', map { "$_: $load{$_}" } sort keys %load) . ')');

# one llama-server goes down
my ($gone) = sort { $load{$b} <=> $load{$a} } keys %load;
$t->stop_llama($gone);
@bad = ();
for my $sid (@sessions) {
    my $r = turn($sid);
    if ($backend{$sid} eq $gone) {
        push @bad, "$sid still on $gone" if $r->{backend} eq $gone;
    } elsif ($r->{backend} ne $backend{$sid}
             || $r->{cached} < $prev{$sid} - 4)
    {
        push @bad, "$sid: on $r->{backend}, $r->{cached} cached of "
                   . "$prev{$sid}";
    }
}
is_deeply(\@bad, [], "llama-server $gone down: its $load{$gone} sessions are "
          . 'served elsewhere, the others stay, with their caches')
    or diag join "\n", @bad;
$t->allow_alerts(qr/connect\(\) failed/);

$t->stop;
done_testing;
