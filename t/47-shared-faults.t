#!/usr/bin/perl

# One store, two owners (shared=on): the shared folder gone (a shared file
# system unmounted, here the folder moved away) and back.  Every request
# is answered; sessions start fresh while it is gone; the files saved
# before are intact and restored once it is back.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
my $dir = $t->dir;
$t->llama(name => $_, ctx => 8192, slots => "$dir/slots") for qw(a b);
$t->nginx($t->owners(names => [qw(a b)], front => 0,
                     store => sub { "$dir/slots" }, zone => ' shared=on'));

sub turn { my ($owner, $sid) = @_; $t->chat_turn($sid, owner => $owner) }

sub files {
    my %f;
    for (glob "$dir/slots/*.bin") {
        my @st = stat $_;
        $f{$_} = "$st[1]:$st[7]:$st[9]";
    }
    return \%f;
}

# s1, s2 saved by a (each swap saves the session going out), s3 on b
turn('a', $_) for qw(s1 s2 s3 s1);
is(turn('b', 's2')->{action}, 'restore', 's2 restores on b');
my $before = files();
cmp_ok(scalar keys %$before, '>=', 2, 'files in the store: '
       . scalar keys %$before);

# the store gone
rename "$dir/slots", "$dir/slots.away" or die;
my @bad;
for my $step ([a => 's3'], [b => 's1'], [a => 's2'], [b => 's3']) {
    my $r = turn(@$step);
    push @bad, "$step->[1] on $step->[0]: $r->{status} $r->{content}"
        if $r->{status} != 200;
    push @bad, "$step->[1] on $step->[0]: $r->{action}"
        if $r->{status} == 200 && $r->{action} ne 'fresh';
}
is_deeply(\@bad, [], 'the store gone: every turn answered, fresh')
    or diag join "\n", @bad;
ok(scalar $t->log_lines(qr/saving session "[^"]+" from slot 0 failed \(500/),
   'the failed saves are logged');

# back: the files saved before are intact, and restored
rename "$dir/slots.away", "$dir/slots" or die;
is_deeply(files(), $before, 'the files saved before it went are intact');
@bad = ();
for my $step ([a => 's1'], [b => 's2']) {
    my $r = turn(@$step);
    push @bad, "$step->[1] on $step->[0]: $r->{status} "
               . ($r->{action} // '') . " $r->{cached} cached of "
               . "$r->{prompt}"
        if $r->{status} != 200 || $r->{action} ne 'restore';
}
is_deeply(\@bad, [], 'the store back: sessions restore their files')
    or diag join "\n", @bad;
$t->allow_alerts(qr/\[crit\]|failed \(2: No such file or directory\)/);

$t->stop;
done_testing;
