#!/usr/bin/perl

# make demo (examples/demo.sh), as a new user runs it on a fresh clone: the
# rig's llama-server with -np 1 behind nginx with examples/nginx.conf (which
# says slots=4: the demo makes it slots=1), two sessions taking turns.  It
# must pass, show both sessions' swaps, and fail loudly (non-zero, the
# reason) when a returning turn does not come back from its cache: here,
# with llama-server's GET /slots off (--no-slots), the module cannot vouch
# for the slot and saves nothing.  A smaller prompt than make demo's.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $root = $LlamaTest::ROOT;

# the rig first (a failure here is the rig's, not the demo's)
LlamaTest::llama_binary();
LlamaTest::llama_model();

sub demo {
    my (%env) = @_;
    my $port = LlamaTest::port();
    my $env = join ' ', map { "$_='$env{$_}'" } sort keys %env;
    my $out = `env DEMO_PORT=$port DEMO_RULES=60 $env timeout 600 $root/examples/demo.sh 2>&1`;
    return ($? >> 8, $out);
}

my ($rc, $out) = demo();
is($rc, 0, 'the demo passes') or diag $out;
my @turns = $out =~ /^  session (\w+)\s+action (\S+)\s+prompt\s+(\d+) tokens, cached\s+(\d+)/mg;
is(scalar(@turns), 16, 'four turns shown') or diag $out;
my %t;
for (my $i = 0; $i + 3 < @turns; $i += 4) {
    push @{ $t{$turns[$i]} }, [ @turns[$i + 1 .. $i + 3] ];
}
for my $s (qw(alice bob)) {
    my ($first, $back) = @{ $t{$s} // [] };
    ok($first && $first->[1] > 1000, "$s: its first turn ran ($first->[1] tokens)");
    is($back && $back->[0], 'restore', "$s: its second turn was restored");
    ok($back && $back->[2] >= $back->[1] - 2,
       "$s: from its cache ($back->[2] of $back->[1] tokens)");
    like($out, qr/swap on slot 0 of zone "llama".* in "$s-\w+" restored \d+ tokens/,
         "the output shows $s\'s swap");
}
like($out, qr/demo passed/, 'and says it passed');
unlike($out, qr/has no slot|FAILED/, 'no slot that llama-server does not have');

($rc, $out) = demo(DEMO_LLAMA_ARGS => '--no-slots');
isnt($rc, 0, 'the demo fails when a returning turn is not cached');
like($out, qr/demo FAILED: session alice came back with \d+ of its \d+ prompt tokens cached/,
     'and says why') or diag $out;

done_testing;
