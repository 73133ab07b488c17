#!/usr/bin/perl

# llama_session_balance over owners with folders of their own (zones not
# shared=on, issue 45): a session with state moves only through a failure,
# since no other owner can restore its file.
#
#   1. its home busy (both slots held), a session with a file waits for
#      its owner and restores there, where with one store it would move;
#   2. its owner's llama-server down, it is answered by another owner
#      (prefilled there: the failure is the one way it moves);
#   3. new sessions are still placed by load: a new session of the busy
#      home goes to another owner at once.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaBalance;
use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep time);

my $t = LlamaTest->new(workers => 2);
my $dir = $t->dir;
my @names = qw(a b c d);
for my $b (@names) {
    LlamaTest::slots_dir("$dir/slots-$b");
    $t->fake(name => $b, np => 2, slots => "$dir/slots-$b");
}
$t->nginx($t->owners(names => \@names,
                     balance => 'llama_session_balance',
                     zone => ' slots=2 save_idle=200ms',
                     store => sub { "$dir/slots-$_[0]" }, fail => '1s'));

my $ring = LlamaTest::chash_ring(map { $_ => $t->owner_port($_) } @names);
sub home { LlamaTest::chash_home($ring, LlamaTest::first_key($_[0])) }

# 1. a busy home: the session with a file waits for it

my $hh = LlamaBalance::hold_home(front => $t, owners => $t, home => \&home);
my ($busy, $h3) = ($hh->{busy}, $hh->{sessions}[2]);

# 3. (while the home is held) a new session of that home goes elsewhere
my $i = 0;
$i++ until home("n$i") eq $busy;
my $r = $t->chat_turn("n$i");
isnt($r->{backend}, $busy, "n$i, new, its home $busy held: placed on "
                           . "$r->{backend} at once");

my $wait = $t->async_post('/v1/chat/completions',
                          { messages => [ @{ $t->{conv}{$h3} } ],
                            max_tokens => 2 },
                          headers => { 'X-Session-Id' => $h3 });
sleep 1;
ok(!$t->async_done($wait), "$h3 waits for its owner $busy");
$hh->{release}->();
my $x = $t->async_wait($wait, 30);
my $u = $x->{json}{usage} // {};
is($x->{status}, 200, "$h3 answered once a slot of $busy is free");
is($x->{headers}{'x-backend'}, $busy, "by $busy, whose folder has its file");
ok(($u->{prompt_tokens_details}{cached_tokens} // 0)
   > 0.9 * ($u->{prompt_tokens} // 1e9),
   "restored: " . ($u->{prompt_tokens_details}{cached_tokens} // 0) . ' of '
   . ($u->{prompt_tokens} // '-') . ' cached');

# 2. its owner down: the failure moves it

sleep 0.6;
$t->stop_proc($busy);
$r = $t->chat_turn($h3);
is($r->{status}, 200, "$h3, its owner's llama-server down: answered");
isnt($r->{backend} // $busy, $busy, 'by another owner: '
                                    . ($r->{backend} // '-'));

$t->stop;
done_testing;
