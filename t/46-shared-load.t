#!/usr/bin/perl

# Routing by load with one store (shared=on): three llama-servers of one
# model over one folder, three owner zones that save a changed slot once
# idle 200 ms, and a front with "least_conn" (docs/scaling.md).  Six
# sessions of unequal size, their turns at once, round after round: a
# session's next turn may land on any owner, and is a restore of the
# state its last turn left, or a hit (with a folder per owner, t/43's
# control, a session that lands elsewhere starts fresh).

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

my %front = (names => [qw(a b c)], balance => 'least_conn',
             zone => ' shared=on save_idle=200ms');
$t->nginx($t->owners(%front, store => sub { "$dir/slots" }));

my $system = join ' ', map { "Rule $_ of the house." } 1 .. 40;
my %size = (big1 => 150, big2 => 150, big3 => 120,
            small1 => 10, small2 => 10, small3 => 20);
my @sessions = sort keys %size;
my %conv;

# a round: every session's turn at once; what each reply says
sub round {
    my %h;
    for my $sid (@sessions) {
        $conv{$sid} //= [ { role => 'system', content => $system },
                          { role => 'user', content => join ' ', map {
                                "Session $sid note $_." } 1 .. $size{$sid} } ];
        $h{$sid} = $t->async_post('/v1/chat/completions',
                                  { messages => $conv{$sid}, max_tokens => 2,
                                    temperature => 0 },
                                  headers => { 'X-Session-Id' => $sid });
    }
    my %out;
    for my $sid (@sessions) {
        my $r = $t->async_wait($h{$sid});
        die "$sid: $r->{status} $r->{content}\n" unless $r->{status} == 200;
        push @{ $conv{$sid} },
            { role => 'assistant',
              content => $r->{json}{choices}[0]{message}{content} },
            { role => 'user', content => "More for $sid?" };
        $out{$sid} = {
            prompt => $r->{json}{usage}{prompt_tokens},
            cached => $r->{json}{usage}{prompt_tokens_details}{cached_tokens},
            action => $r->{headers}{'x-s-action'},
            backend => $r->{headers}{'x-backend'} };
    }
    # the changed slots are saved once idle
    sleep 1;
    return \%out;
}

round();
my (@bad, %moves, %served, %tokens);
my $turns = 0;
my %last;
for my $n (1 .. 4) {
    my $out = round();
    for my $sid (@sessions) {
        my $r = $out->{$sid};
        $turns++;
        $served{$r->{backend}}++;
        $tokens{$r->{backend}} += $r->{prompt};
        $moves{$sid}++ if defined $last{$sid} && $last{$sid} ne $r->{backend};
        $last{$sid} = $r->{backend};
        push @bad, "round $n, $sid on $r->{backend}: $r->{action}, "
                   . "$r->{cached} cached of $r->{prompt}"
            if ($r->{action} ne 'restore' && $r->{action} ne 'hit')
               || $r->{cached} < 0.9 * $r->{prompt};
    }
}
my $moved = 0;
$moved += $_ for values %moves;
cmp_ok(scalar keys %served, '==', 3, 'least_conn serves from every owner ('
       . join(', ', map { "$_: $served{$_} turns, $tokens{$_} tokens" }
                    sort keys %served) . ")");
cmp_ok($moved, '>=', 3, "sessions change owners ($moved times in $turns "
       . 'turns)');
is_deeply(\@bad, [], "every returning turn is a restore or a hit, >= 90 % "
          . "cached ($turns turns)") or diag join "\n", @bad;

$t->stop;
done_testing;
