#!/usr/bin/perl

# llama_session_balance over owners on other hosts (issue 45): an edge
# nginx with "llama_session identity" in front of four owners of two
# slots over one store (another nginx here, as it would be on other
# hosts).  The edge has no owner zone: it keeps what the owners' replies
# tell it (X-Llama-Session-Owner: their load and the sessions in their
# slots) and takes that header out of the reply.  The fake backend, whose
# completions a test can hold, makes the load.
#
#   1. a new session goes home (nginx's consistent-hash ring); the owner's
#      header never reaches the client; an owner asked by an edge tells;
#   2. its home busy (both slots held), a session with a file restores on
#      another owner at once; its next turn stays there, a hit, where the
#      hash would send it home: the edge learned where it lives;
#      its next turn, straight to its home owner (another edge's), is
#      seen there by the edge's polls of the owners: the turn after goes
#      there, a hit;
#      2c. an owner's told load counts with the turns the edge sent it
#      since: a turn does not queue where one came another way;
#   3. an owner down: its sessions answered elsewhere, restored;
#   4. nginx -t: poll= out of range.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use Compress::Zlib qw(crc32);
use LlamaBalance;
use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep);

my $o = LlamaTest->new(workers => 2);
my $dir = $o->dir;
my @names = qw(a b c d);
LlamaTest::slots_dir("$dir/slots");
$o->fake(name => $_, np => 2, slots => "$dir/slots") for @names;
$o->nginx($o->owners(names => \@names, front => 0,
                     zone => ' slots=2 shared=on save_idle=200ms',
                     store => sub { "$dir/slots" }));

my $servers = join '', map { "        server 127.0.0.1:"
                             . $o->owner_port($_)
                             . " max_fails=1 fail_timeout=1s;\n" } @names;
my $e = LlamaTest->new(workers => 2);
$e->nginx(<<"EOF");
    upstream owners {
        zone owners 64k;
        llama_session_balance;
$servers    }

    server {
        listen 127.0.0.1:%%PORT%%;

        location / {
            llama_session identity;
            proxy_pass http://owners;
            proxy_read_timeout 300s;
            proxy_next_upstream error timeout http_502 non_idempotent;
        }
    }
EOF

# nginx's consistent hash ring over the owners, and a new session's home
my $ring = LlamaTest::chash_ring(map { $_ => $o->owner_port($_) } @names);
sub home { LlamaTest::chash_home($ring, LlamaTest::first_key($_[0])) }

# a turn through the edge; the owner is known by its X-Backend header
sub turn { $e->chat_turn($_[0]) }

# 1. homes; the owner's header stays between the owner and the edge

my @first = map { "s$_" } 1 .. 6;
my ($homes, $told) = (0, 0);
for my $sid (@first) {
    my $r = turn($sid);
    is($r->{status}, 200, "$sid: first turn");
    $homes++ if ($r->{backend} // '') eq home($sid);
    $told++ if exists $r->{headers}{'x-llama-session-owner'};
    sleep 0.5;    # its idle save done
}
is($homes, scalar @first, "every new session went home ($homes of "
                          . scalar(@first) . ')');
is($told, 0, 'no reply to a client carries X-Llama-Session-Owner');

my $r = turn('s6');
is("$r->{backend} $r->{action}", home('s6') . ' hit', 's6 again: a hit at home');

my $owner = home('s6');
my $direct = $o->post('/v1/chat/completions',
                      { messages => $e->{conv}{s6}, max_tokens => 2 },
                      port => $o->owner_port($owner),
                      headers => { 'X-Session-Id' => 's6',
                                   'X-Llama-Session-Edge' => '1' });
like($direct->{headers}{'x-llama-session-owner'} // '',
     qr/^l=\d+ s=2 t=\d+ r=\d+ p=\d+ sh=1 k=[0-9a-f]+\+?(?::\d+)?,[0-9a-f]+\+?(?::\d+)?$/,
     'an owner asked by an edge tells its load and slots: '
     . ($direct->{headers}{'x-llama-session-owner'} // '-'));
my $k6 = sprintf '%x', crc32(LlamaTest::first_key('s6'));
like($direct->{headers}{'x-llama-session-owner'} // '', qr/k=(?:.*,)?$k6\b/,
     "with s6's key in a slot ($k6)");
push @{ $e->{conv}{s6} }, { role => 'assistant',
                       content => $direct->{json}{choices}[0]{message}{content} },
                     { role => 'user', content => 'More for s6?' };

# 2. a busy home: the third session of that home restores elsewhere at
# once; then the edge sends it where it lives

my $bh = LlamaBalance::busy_home(front => $e, owners => $o, home => \&home);
my ($busy, $moved) = @{$bh}{qw(busy moved)};
my ($h1, $h2, $h3) = @{ $bh->{sessions} };

$r = turn($h3);
is("$r->{backend} $r->{action}", "$moved hit",
   "$h3 again, its home free: it stays where it lives, a hit "
   . "(the hash would send it home to $busy)");

# 2b. the session's next turn reaches its home owner by another way (an
# edge of another kind, a client of the owner): the edge's polls see it
# there, used last, and send the turn after it, a hit

my $d = $o->post('/v1/chat/completions',
                 { messages => $e->{conv}{$h3}, max_tokens => 2,
                   temperature => 0 },
                 port => $o->owner_port($busy),
                 headers => { 'X-Session-Id' => $h3 });
is("$d->{status} " . ($d->{headers}{'x-s-action'} // '-'), '200 restore',
   "$h3 straight to $busy: restored there");
push @{ $e->{conv}{$h3} },
    { role => 'assistant', content => $d->{json}{choices}[0]{message}{content} },
    { role => 'user', content => "More for $h3?" };
sleep 2.5;    # poll=1s: the edge asks the owners it has not heard of
$r = turn($h3);
is("$r->{backend} $r->{action}", "$busy hit",
   "$h3 through the edge: to $busy, where it was used last, a hit (its "
   . "older state in a slot of $moved)");

# 2c. two ways into one owner: the load it told the edge counts with the
# turns the edge sent it since.  Owner $x runs one turn it got another way
# (held); a turn through the edge ends there and tells load 1; a second,
# held, goes there too (1 of 2 slots busy, as told).  A third new session
# of that home finds it full (told 1, and one sent since): it goes to
# another owner at once, not into $x's queue behind the held turns

my $x = (grep { $_ ne $busy && $_ ne $moved } @names)[0];
my ($q1, $q0, $q2, $q3) = map { LlamaBalance::new_of(\&home, $x, 'q') } 1 .. 4;
my $until = $o->dir . '/release-q';
unlink $until;
$o->fake_script({ completion => { match => "Session (?:$q1|$q2) note",
                                  delay_ms => 1, until => $until } }, $x);
my $held1 = $o->async_post('/v1/chat/completions',
                           { messages => LlamaTest::first_conv($q1),
                             max_tokens => 2 },
                           port => $o->owner_port($x),
                           headers => { 'X-Session-Id' => $q1 });
sleep 0.5;
$r = turn($q0);
is("$r->{status} " . ($r->{backend} // '-'), "200 $x",
   "$q0: home $x, one slot of it taken another way");
my $held2 = $e->async_post('/v1/chat/completions',
                           { messages => LlamaTest::first_conv($q2),
                             max_tokens => 2 },
                           headers => { 'X-Session-Id' => $q2 });
sleep 0.3;
my $third = $e->async_post('/v1/chat/completions',
                           { messages => LlamaTest::first_conv($q3),
                             max_tokens => 2 },
                           headers => { 'X-Session-Id' => $q3 });
my $t = $e->async_wait($third, 5);
is($t->{status}, 200, "$q3: answered while both slots of $x are held");
my $went = $t->{headers}{'x-backend'} // '-';
ok($t->{status} == 200 && $went ne $x,
   "$q3: to another owner ($went): $x told load 1 and got one turn since");
open my $fh, '>', $until or die;
close $fh;
is($o->async_wait($held1, 30)->{status}, 200, "$q1 (held at $x) ends");
my $w2 = $e->async_wait($held2, 30);
is("$w2->{status} " . ($w2->{headers}{'x-backend'} // '-'), "200 $x",
   "$q2 (held) went to $x and ends");
$o->fake_script({}, $x);

# 3. an owner down: its sessions answered elsewhere, from their files

sleep 0.6;
my @its = grep { home($_) eq $busy } @first, $h1, $h2;
$o->stop_proc($busy);
for my $sid (@its) {
    my $x = turn($sid);
    is($x->{status}, 200, "$sid: its owner $busy down, answered");
    isnt($x->{backend} // $busy, $busy, 'elsewhere: ' . ($x->{backend} // '-'));
    ok(($x->{cached} // 0) > 0.9 * ($x->{prompt} // 1e9),
       "$sid: restored, " . ($x->{cached} // 0) . ' of '
       . ($x->{prompt} // '-') . ' cached');
}

# 4. nginx -t: poll= out of range

my ($rc, $msg) = $e->nginx_test(<<"EOF");
    upstream owners {
        llama_session_balance poll=10ms;
$servers    }
EOF
isnt($rc, 0, 'nginx -t refuses poll=10ms');
like($msg, qr/invalid "poll=10ms": poll= is how long an owner on another host may go unheard/,
     'and says what poll= is');

$e->stop;
$o->stop;
done_testing;
