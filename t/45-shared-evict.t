#!/usr/bin/perl

# One store, two owners (shared=on): eviction that does not fight.  Owner
# a keeps at most two files (max_files=2); a session it saved, then moved
# to owner b (which restored it there), is not deleted by a's eviction:
# b's use is newer than a's.  A session no other owner used goes as
# before.  A zone's temporary and set-aside files are its own.

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
    zone => sub { ' shared=on' . ($_[0] eq 'a' ? ' max_files=2' : '') }));

# each session with a system prompt of its own: no base of a shared one
sub turn {
    my ($owner, $sid) = @_;
    my $r = $t->chat_turn($sid, owner => $owner, notes => 30,
                          system => join ' ', map { "Rule $_ for $sid." }
                                                  1 .. 30);
    die "$sid on $owner: $r->{status} $r->{content}\n"
        unless $r->{status} == 200;
    return $r->{action};
}

sub key { $t->chat_key($_[0]) }

sub has_file { my @f = glob "$dir/slots/${\key($_[0])}.*.bin"; scalar @f }

turn('a', 'e1');
turn('a', 'e2');
ok(has_file('e1'), 'a saved e1 when e2 took its slot');
is(turn('b', 'e1'), 'restore', 'e1 moves to b and restores a\'s file');

turn('a', 'e3');
turn('a', 'e4');
turn('a', 'e5');
my $k1 = key('e1');
ok(scalar $t->log_lines(qr/session "\Q$k1\E\.[0-9a-f]{8}" of the shared store is not evicted: another owner used it since zone "a" did/),
   'a\'s eviction leaves e1: b used it after a');
ok(has_file('e1'), 'e1\'s file is there');
ok(!has_file('e2'), 'e2, which no other owner used, was evicted by a');
is(turn('b', 'e1'), 'hit', 'e1 on b');
turn('b', 'e6');
is(turn('b', 'e1'), 'restore', 'e1 restores on b after e6 took its slot');

# review 4: another owner's newer .bin renamed in before its .json is
# written (or that write failed on a full disk): a's eviction leaves it
# for the grace period, whatever the .json says
turn('a', 'e7');
turn('a', 'e8');
ok(has_file('e7'), 'a saved e7');
{
    my ($bin) = glob "$dir/slots/${\key('e7')}.*.bin";
    # as b's commit does: its own file, renamed over the name
    system('cp', '-p', $bin, "$bin.b.tmp") == 0 or die;
    utime time, time, "$bin.b.tmp";
    rename "$bin.b.tmp", $bin or die;
}
turn('a', 'e9');
turn('a', 'e10');
my $k7 = key('e7');
ok(scalar $t->log_lines(qr/session "\Q$k7\E\.[0-9a-f]{8}" of the shared store is not evicted: another owner used it since zone "a" did/),
   'a\'s eviction leaves e7: another owner renamed a newer file in');
ok(has_file('e7'), 'e7\'s newer file is there, its .json not written');

# a zone's temporary and set-aside names are its own
my @own = grep { /\.bin\.[0-9a-f]{8}\.(tmp|old)$|\.json\.[0-9a-f]{8}\.tmp$/ }
          glob "$dir/slots/*";
is_deeply(\@own, [], 'no temporary or set-aside file stays');
my @shared = grep { /\.bin\.(tmp|old)$|\.json\.tmp$/ } glob "$dir/slots/*";
is_deeply(\@shared, [], 'none of the unshared names either');

$t->stop;
done_testing;
