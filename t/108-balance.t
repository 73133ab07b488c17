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
#   4. nginx -t: a server with no owner zone in this nginx, backup
#      servers, a factor out of range.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use Compress::Zlib qw(crc32);
use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep);

my $t = LlamaTest->new(workers => 2);
my $dir = $t->dir;
my @names = qw(a b c d);
LlamaTest::slots_dir("$dir/slots");
$t->fake(name => $_, np => 2, slots => "$dir/slots") for @names;
$t->nginx($t->owners(names => \@names,
                     balance => 'llama_session_balance',
                     zone => ' slots=2 shared=on save_idle=200ms',
                     store => sub { "$dir/slots" }));

# nginx's consistent hash ring over the owners: crc32(HOST \0 PORT PREV),
# 160 points each; a key's home is the first point at or after crc32(key)
my @ring;
for my $b (@names) {
    my $port = $t->owner_port($b);
    my $base = "127.0.0.1\0$port";
    my $prev = 0;
    for (1 .. 160) {
        my $h = crc32(pack('V', $prev), crc32($base));
        push @ring, [ $h, $b ];
        $prev = $h;
    }
}
@ring = sort { $a->[0] <=> $b->[0] } @ring;

# the key of chat_turn()'s conversation, before its first turn too
sub key {
    my ($sid) = @_;
    return LlamaTest::session_key($sid, body => { messages => [
        { role => 'system',
          content => join ' ', map { "Rule $_ of the house." } 1 .. 40 },
        { role => 'user',
          content => join ' ', map { "Session $sid note $_." } 1 .. 40 } ] });
}

sub home {
    my ($sid) = @_;
    my $h = crc32(key($sid));
    for my $p (@ring) {
        return $p->[1] if $p->[0] >= $h;
    }
    return $ring[0][1];
}

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

# 2. a busy home: three sessions of one home; two held in its slots

my %by;
my $n = 0;
my ($h1, $h2, $h3);
while (!$h3) {
    my $sid = 'h' . $n++;
    my $home = home($sid);
    push @{ $by{$home} }, $sid;
    ($h1, $h2, $h3) = @{ $by{$home} } if @{ $by{$home} } == 3;
}
my $busy = home($h1);
diag("$h1, $h2, $h3: home $busy");

# h3 first, so that it has a file; then h1 and h2 take the two slots
for my $sid ($h3, $h1, $h2) {
    is($t->chat_turn($sid)->{backend}, $busy, "$sid: home $busy");
    sleep 0.5;    # save_idle: its file
}

my $until = "$dir/release";
$t->fake_script({ completion => { match => "(?:$h1|$h2)\\b", delay_ms => 1,
                                  until => $until } }, $busy);
my @held = map { $t->async_post('/v1/chat/completions',
                                { messages => [ @{ $t->{conv}{$_} } ],
                                  max_tokens => 2 },
                                headers => { 'X-Session-Id' => $_ }) }
           $h1, $h2;
sleep 1;

my $t0 = Time::HiRes::time();
$r = $t->chat_turn($h3);
my $secs = Time::HiRes::time() - $t0;
is($r->{status}, 200, "$h3 while ${busy}'s slots are held");
isnt($r->{backend}, $busy, "$h3 went to another owner ($r->{backend})");
is($r->{action}, 'restore', 'a restore there');
ok($r->{cached} > 0.9 * $r->{prompt},
   "from its file: $r->{cached} of $r->{prompt} cached");
ok($secs < 5, sprintf('at once (%.1f s), not after the held turns', $secs));

open my $fh, '>', $until or die;
close $fh;
for my $h (@held) {
    is($t->async_wait($h, 30)->{status}, 200, 'a held turn ends');
}
$t->fake_script({}, $busy);

# 3. an owner down: its sessions go on elsewhere, from their files

sleep 0.6;
my @its = grep { home($_) eq $busy } @first, $h1, $h2;
$t->stop_proc($busy);
my %where;
for my $sid (@its) {
    my $x = $t->chat_turn($sid);
    is($x->{status}, 200, "$sid: its owner $busy down, answered");
    isnt($x->{backend} // $busy, $busy, "elsewhere: " . ($x->{backend} // '-'));
    ok(($x->{cached} // 0) > 0.9 * ($x->{prompt} // 1e9),
       "$sid: restored, $x->{cached} of $x->{prompt} cached");
    $where{ $x->{backend} // '' }++;
}

# 4. nginx -t

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
