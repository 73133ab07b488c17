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
my %port = (a => '%%PORT%%', b => LlamaTest::port());
for my $b (qw(a b)) {
    $t->llama(name => $b, ctx => 8192, slots => "$dir/slots");
}

my $conf = '';
for my $b (qw(a b)) {
    $conf .= <<"EOF";
    llama_session_zone zone=$b:1m store=$dir/slots shared=on;

    server {
        listen 127.0.0.1:$port{$b};

        location / {
            llama_session $b;
            proxy_pass http://127.0.0.1:%%LLAMA:$b%%;
            proxy_read_timeout 300s;
            add_header X-S-Action \$llama_session_action always;
        }

        location /_llama_slots/ {
            internal;
            proxy_pass http://127.0.0.1:%%LLAMA:$b%%/;
        }
    }

EOF
}
$t->nginx($conf);

my $system = join ' ', map { "Rule $_ of the house." } 1 .. 40;
my %conv;

sub turn {
    my ($owner, $sid) = @_;
    $conv{$sid} //= [ { role => 'system', content => $system },
                      { role => 'user', content => join ' ', map {
                            "Session $sid note $_." } 1 .. 40 } ];
    my $r = $t->post('/v1/chat/completions',
                     { messages => $conv{$sid}, max_tokens => 2,
                       temperature => 0 },
                     headers => { 'X-Session-Id' => $sid },
                     $owner eq 'a' ? () : (port => $port{b}));
    return { status => $r->{status}, content => $r->{content} }
        unless $r->{status} == 200;
    push @{ $conv{$sid} },
        { role => 'assistant',
          content => $r->{json}{choices}[0]{message}{content} },
        { role => 'user', content => "More for $sid?" };
    return { status => 200, prompt => $r->{json}{usage}{prompt_tokens},
             cached => $r->{json}{usage}{prompt_tokens_details}{cached_tokens},
             action => $r->{headers}{'x-s-action'} };
}

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
