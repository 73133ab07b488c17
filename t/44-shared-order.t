#!/usr/bin/perl

# One store, two owners (shared=on): the order of two owners' saves of one
# session.  A front would move a session between owners; the test talks
# to each owner itself, so each move is known.  Owner a keeps a changed
# session in its slot (no save_idle), owner b saves it once idle.
#
# - a stale hit: a's slot still holds a session's earlier turn when the
#   session comes back after turns on b, which b saved: the newer file is
#   restored, not the slot's older state reused;
# - a save of an older state: a's slot's state of a session that b saved
#   since, with more tokens, is not kept (the swap line says so); b's
#   file stays;
# - an older save by the first owner (after the session had moved on) is
#   replaced by the later turn's save of the second;
# - the API's save of such a slot answers that the store's is newer.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
my $dir = $t->dir;
$t->llama(name => $_, ctx => 8192, slots => "$dir/slots") for qw(a b);
$t->nginx($t->owners(
    names => [qw(a b)], front => 0, store => sub { "$dir/slots" },
    zone => sub { ' shared=on' . ($_[0] eq 'b' ? ' save_idle=1s' : '') },
    extra => sub { "location /api/ { llama_session_api $_[0]; }\n"
                   . "        location = /metrics { llama_session_metrics "
                   . "$_[0]; }" }));

sub turn {
    my ($owner, $sid) = @_;
    my $r = $t->chat_turn($sid, owner => $owner, max_tokens => 4);
    die "$sid on $owner: $r->{status} $r->{content}\n"
        unless $r->{status} == 200;
    return $r;
}

sub key { $t->chat_key($_[0]) }

# the session's file and what its .json says
sub file {
    my ($sid) = @_;
    my $key = key($sid);
    my ($bin) = glob "$dir/slots/$key.*.bin";
    return {} unless $bin;
    my $json = $bin =~ s/\.bin$/.json/r;
    my $meta = -f $json ? JSON::PP::decode_json($t->read_file($json)) : {};
    return { ino => (stat $bin)[1], tokens => $meta->{tokens} // 0 };
}

sub metric {
    my ($owner, $at) = @_;
    my $m = $t->get('/metrics', port => $t->owner_port($owner))->{content};
    return $m =~ /^nginx_llama_session_shared_newer_total\{zone="$owner",at="$at"\} (\d+)$/m
        ? $1 : -1;
}

sub idle_saved {
    my ($sid, $n) = @_;
    return $t->wait_for(sub {
        my @l = $t->log_lines(qr/idle save of "\Q${\key($sid)}\E"/);
        @l >= $n;
    }, 15);
}

# a stale hit: s1 on a, then on b (saved there), then on a again

my $r = turn('a', 's1');
is($r->{action}, 'fresh', 's1 starts on a');
my $t1 = turn('b', 's1');
ok(idle_saved('s1', 1), 'b saves s1 once idle');
my $saved = file('s1');
$r = turn('a', 's1');
is($r->{action}, 'restore', "s1 back on a, whose slot holds its first turn: "
   . 'the newer file is restored');
cmp_ok($r->{cached}, '>=', $t1->{prompt},
       "with the turn served on b ($r->{cached} cached, b's prompt "
       . "$t1->{prompt})");
ok(scalar $t->log_lines(qr/swap on slot 0 of zone "a": out its own older state \(another owner saved a newer one since\), in "\Q${\key('s1')}\E" restored/),
   'the swap line says the slot held an older state');
is(metric('a', 'hit'), 1, 'counted: shared_newer_total{at="hit"}');

# an older save not kept: s2 on a (changed, kept in a's slot), then on b
# (saved there); s3 on a takes the slot: a's save of s2 finds b's newer

turn('a', 's2');
my $t2 = turn('b', 's2');
ok(idle_saved('s2', 1), 'b saves s2 once idle');
$saved = file('s2');
turn('a', 's3');
my $key2 = key('s2');
ok(scalar $t->log_lines(qr/another owner saved session "\Q$key2\E" since slot 0 of zone "a" took it in, \d+ tokens against the slot's \d+: its newer file stays/),
   "a's save of s2's older state is not kept");
ok(scalar $t->log_lines(qr/swap on slot 0 of zone "a": out "\Q$key2\E" not saved \(another owner saved a newer state, it stays\)/),
   'the swap line says so');
is_deeply(file('s2'), $saved, "b's file of s2 stays ($saved->{tokens} tokens)");
is(metric('a', 'save'), 1, 'counted: shared_newer_total{at="save"}');
$r = turn('a', 's2');
is($r->{action}, 'restore', 's2 on a again restores b\'s file');
cmp_ok($r->{cached}, '>=', $t2->{prompt}, "with b's turn ($r->{cached} "
       . "cached, b's prompt $t2->{prompt})");

# an older save replaced: s4 on a, then on b; a saves s4's first turn
# through the API after b took it in; b's idle save of the later turn
# replaces it

turn('a', 's4');
my $t4 = turn('b', 's4');
$r = $t->post('/api/sessions/save', '');
is($r->{status}, 200, 'API save on a');
my ($item) = grep { ($_->{key} // '') eq key('s4') }
             @{ $r->{json}{saved} // [] };
ok($item && $item->{tokens}, "a saved s4's first turn ("
   . ($item ? $item->{tokens} // '?' : 'none') . ' tokens)');
ok(idle_saved('s4', 1), 'b saves s4 once idle');
my $key4 = key('s4');
ok(scalar $t->log_lines(qr/another owner saved session "\Q$key4\E" since slot 0 of zone "b" took it in, \d+ tokens against the slot's \d+: replaced/),
   "b's later turn replaces a's save of the earlier one");
cmp_ok(file('s4')->{tokens}, '>', $item ? $item->{tokens} // 0 : 0,
       'the file holds the later turn');

# the API's save of a slot whose session another owner saved since

$r = turn('a', 's5');
turn('b', 's5');
ok(idle_saved('s5', 1), 'b saves s5 once idle');
$saved = file('s5');
$r = $t->post('/api/sessions/save', '');
is($r->{status}, 200, 'API save on a: no failure');
($item) = grep { ($_->{key} // '') eq key('s5') }
          @{ $r->{json}{saved} // [] };
ok($item && $item->{newer_in_store}, 'the answer says the store holds a '
   . 'newer state') or diag explain $r->{json};
is_deeply(file('s5'), $saved, "b's file of s5 stays");

$t->stop;
done_testing;
