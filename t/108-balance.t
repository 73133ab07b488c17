#!/usr/bin/perl

# llama_session_balance (issue 45): four owners of two slots over one
# store (shared=on, saves 200 ms after a turn), the front balancing by
# where a session's state is and how loaded each owner is.  The fake
# backend, whose completions a test can hold, makes the load.
#
#   1. a new session goes home: the owner nginx's "hash ... consistent"
#      gives it (the ring computed here as nginx does); its next turn, in
#      its slot there, is a hit;
#   2. its home busy (both slots held), a session with a file restores on
#      another owner at once instead of waiting; a session held in a slot
#      under the bound stays a hit;
#   3. an owner down: its sessions restore on the others, every turn 200;
#      back, added, removed by a reload; residency=off goes by the ring;
#   4. nginx -t: a server with no owner zone in this nginx, backup
#      servers, a factor out of range.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaBalance;
use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep);

my @names = qw(a b c d);
my $t = LlamaBalance::fleet(names => \@names);
my $dir = $t->dir;

# nginx's consistent hash ring over the owners, and a new session's home
my $ring;
sub ring {
    $ring = LlamaTest::chash_ring(map { $_ => $t->owner_port($_) } @names);
}
ring();

sub home { LlamaTest::chash_home($ring, LlamaTest::first_key($_[0])) }

# a session of a home, new
sub new_of { LlamaBalance::new_of(\&home, $_[0], "$_[0]-new") }

# 1. homes and hits

my @first = map { "s$_" } 1 .. 6;
my $homes = 0;
for my $sid (@first) {
    my $r = $t->chat_turn($sid);
    is($r->{status}, 200, "$sid: first turn");
    $homes++ if ($r->{backend} // '') eq home($sid);
    sleep 0.5;    # its idle save done: every owner idle again
}
is($homes, scalar @first, "every new session went home ($homes of "
                          . scalar(@first) . ')');

my $r = $t->chat_turn('s6');
is($r->{action}, 'hit', 's6 again: a hit');
is($r->{backend}, home('s6'), 'on its home');

# 2. a busy home: three sessions of one home; two held in its slots, the
# third, with a file, restores on another owner at once

my $bh = LlamaBalance::busy_home(front => $t, owners => $t, home => \&home);
my $busy = $bh->{busy};
my ($h1, $h2) = @{ $bh->{sessions} };

# 3. an owner down: its sessions, arriving together, restore on the
# others, spread by the bound (not all onto the ring's successor)

sleep 0.6;
my @its = grep { home($_) eq $busy } @first, $h1, $h2;
push @its, new_of($busy) while @its < 3;
for my $sid (@its) {
    next if $t->{conv}{$sid};
    $t->chat_turn($sid);    # its first turn, at home: its file
    sleep 0.5;
}
$t->stop_proc($busy);
my @live = grep { $_ ne $busy } @names;
$t->fake_script({ completion => { delay_ms => 1500 } }, $_) for @live;
my @moving;
for my $sid (@its) {
    push @moving, $t->async_post('/v1/chat/completions',
                                 { messages => [ @{ $t->{conv}{$sid} } ],
                                   max_tokens => 2 },
                                 headers => { 'X-Session-Id' => $sid });
    sleep 0.3;
}
my (%where, %where_of);
for my $sid (@its) {
    my $x = $t->async_wait(shift @moving, 30);
    my $b = $x->{headers}{'x-backend'} // '-';
    my $u = $x->{json}{usage} // {};
    my $cached = $u->{prompt_tokens_details}{cached_tokens} // 0;
    is($x->{status}, 200, "$sid: its owner $busy down, answered");
    isnt($b, $busy, "elsewhere: $b");
    ok($cached > 0.9 * ($u->{prompt_tokens} // 1e9),
       "$sid: restored, $cached of " . ($u->{prompt_tokens} // '-')
       . ' cached');
    $where{$b}++;
    $where_of{$sid} = $b;
}
cmp_ok(scalar keys %where, '>=', 2, 'spread over the others, not all onto '
       . 'one (' . join(', ', map { "$_: $where{$_}" } sort keys %where)
       . ')');
$t->fake_script({}, $_) for @live;

# the sessions the slots of each owner hold: the last two it served
my %served;
for my $sid (@its) {
    my $b = $where_of{$sid};
    @{ $served{$b} } = ((grep { $_ ne $sid } @{ $served{$b} // [] }), $sid);
}
my @resident = map { @{ $served{$_} }[-2 .. -1] }
               grep { @{ $served{$_} } >= 2 } sort keys %served;
push @resident, map { @{ $served{$_} } } grep { @{ $served{$_} } == 1 }
                                         sort keys %served;

# 4. the owner back (its fail_timeout over): the sessions that moved stay
# where their slots hold them; new sessions of its home go to it again

$t->fake(name => $busy, np => 2, slots => "$dir/slots",
         port => $t->{llama_port}{$busy});
sleep 1.5;
for my $sid (@resident) {
    my $x = $t->chat_turn($sid);
    is("$x->{backend} $x->{action}", "$where_of{$sid} hit",
       "$busy back: $sid stays a hit on $where_of{$sid}");
}
my $new = new_of($busy);
is($t->chat_turn($new)->{backend}, $busy, "$new, new, goes to $busy, home");

# 5. an owner added by a reload: the sessions in slots stay hits; new
# sessions it is home to go to it; a session with a file and no slot
# restores there

sub reload_owners {
    my ($balance) = @_;
    $t->nginx($t->owners(names => \@names,
                         balance => $balance // 'llama_session_balance',
                         zone => ' slots=2 shared=on save_idle=200ms',
                         store => sub { "$dir/slots" }, fail => '1s'),
              write_only => 1);
    $t->reload;
    ring();
    sleep 1;
}

sleep 0.5;
$t->fake(name => 'e', np => 2, slots => "$dir/slots");
push @names, 'e';
reload_owners();
for my $sid (@resident) {
    my $x = $t->chat_turn($sid);
    is("$x->{backend} $x->{action}", "$where_of{$sid} hit",
       "e added: $sid stays a hit on $where_of{$sid}");
}
$new = new_of('e');
is($t->chat_turn($new)->{backend}, 'e', "$new, new, goes to e, home");

# 6. an owner removed by a reload: the sessions its slots held restore on
# the others

sleep 0.5;
my $gone = $where_of{ $resident[0] };
my @gone = grep { $where_of{$_} eq $gone } @resident;
@names = grep { $_ ne $gone } @names;
reload_owners();
for my $sid (@gone) {
    my $x = $t->chat_turn($sid);
    is($x->{status}, 200, "$gone removed: $sid answered");
    isnt($x->{backend}, $gone, "elsewhere: $x->{backend}");
    ok(($x->{cached} // 0) > 0.9 * ($x->{prompt} // 1e9),
       "$sid: restored, $x->{cached} of $x->{prompt} cached");
}

# 6b. residency=off (plain bounded loads, the bench's side): no slot is
# read, ties go by the ring.  Every owner's two slots filled with new
# sessions, s1's home last: s1, with a file, restores at home, not on the
# owner whose slots have been idle longest

sleep 0.5;
reload_owners('llama_session_balance residency=off');
my $h = home('s1');
for my $o ((grep { $_ ne $h } @names), $h) {
    for (1 .. 2) {
        my $sid = new_of($o);
        is($t->chat_turn($sid)->{backend}, $o, "residency=off: $sid, new, home");
        sleep 0.3;
    }
}
$r = $t->chat_turn('s1');
is("$r->{backend} $r->{action}", "$h restore",
   "residency=off: s1 restores at home $h, its slots used last");

# 7. nginx -t

my $port = $t->owner_port('a');
my $owner = <<"EOF";
    llama_session_zone zone=o:1m;
    server {
        listen 127.0.0.1:$port;
        location / { llama_session o; proxy_pass http://127.0.0.1:1; }
        location /_llama_slots/ { internal; proxy_pass http://127.0.0.1:1/; }
    }
EOF
my ($rc, $msg) = $t->nginx_test($owner . <<"EOF");
    upstream owners {
        llama_session_balance;
        server 127.0.0.1:$port;
        server 127.0.0.1:9;
    }
    server {
        listen 127.0.0.1:%%PORT%%;
        location / { llama_session identity; proxy_pass http://owners; }
    }
EOF
isnt($rc, 0, 'nginx -t refuses a server with no owner zone');
like($msg, qr/server "127\.0\.0\.1:9" \(127\.0\.0\.1:9\) has no owner zone in this nginx/,
     'and names it');

($rc, $msg) = $t->nginx_test($owner . <<"EOF");
    upstream owners {
        server 127.0.0.1:$port backup;
        llama_session_balance factor=1.5;
        server 127.0.0.1:$port;
    }
EOF
like($msg, qr/takes no "backup" servers/, 'backup servers are refused');

($rc, $msg) = $t->nginx_test(<<"EOF");
    upstream owners {
        llama_session_balance factor=9;
        server 127.0.0.1:$port;
    }
EOF
like($msg, qr/invalid "factor=9": factor= is the load bound/,
     'a factor out of range is refused');

$t->stop;
done_testing;
