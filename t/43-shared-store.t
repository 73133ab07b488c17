#!/usr/bin/perl

# One store for the owners of one model (shared=on): three llama-servers
# of one model write one folder, three owner zones, a front that routes
# each session by "hash $llama_session_key consistent".  An owner whose
# llama-server goes down: its sessions go to the others, and their next
# turns restore the files it saved (with a folder per llama-server, as
# before, they start fresh: 0 cached of ~700 tokens).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
my $dir = $t->dir;
my %port;
for my $b (qw(a b c)) {
    $t->llama(name => $b, ctx => 8192, slots => "$dir/slots");
    $port{$b} = LlamaTest::port();
}

my $conf = '';
for my $b (qw(a b c)) {
    $conf .= <<"EOF";
    llama_session_zone zone=$b:1m store=$dir/slots shared=on save_idle=1s;

    server {
        listen 127.0.0.1:$port{$b};

        location / {
            llama_session $b;
            proxy_pass http://127.0.0.1:%%LLAMA:$b%%;
            proxy_read_timeout 300s;
            add_header X-S-Action \$llama_session_action always;
            add_header X-Backend $b always;
        }

        location /_llama_slots/ {
            internal;
            proxy_pass http://127.0.0.1:%%LLAMA:$b%%/;
        }
    }

EOF
}
$conf .= <<"EOF";
    upstream backends {
        hash \$llama_session_key consistent;
        server 127.0.0.1:$port{a} max_fails=1 fail_timeout=3s;
        server 127.0.0.1:$port{b} max_fails=1 fail_timeout=3s;
        server 127.0.0.1:$port{c} max_fails=1 fail_timeout=3s;
    }

    server {
        listen 127.0.0.1:%%PORT%%;

        location / {
            llama_session identity;
            proxy_pass http://backends;
            proxy_read_timeout 300s;
            proxy_next_upstream error timeout http_502 non_idempotent;
        }
    }
EOF
$t->nginx($conf);

my $system = join ' ', map { "Rule $_ of the house." } 1 .. 40;
my (%conv, %backend, %prev);

sub turn {
    my ($sid) = @_;
    $conv{$sid} //= [ { role => 'system', content => $system },
                      { role => 'user', content => join ' ', map {
                            "Session $sid note $_." } 1 .. 40 } ];
    my $r = $t->post('/v1/chat/completions',
                     { messages => $conv{$sid}, max_tokens => 2,
                       temperature => 0 },
                     headers => { 'X-Session-Id' => $sid });
    die "$sid: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    push @{ $conv{$sid} },
        { role => 'assistant',
          content => $r->{json}{choices}[0]{message}{content} },
        { role => 'user', content => "More for $sid?" };
    return { prompt => $r->{json}{usage}{prompt_tokens},
             cached => $r->{json}{usage}{prompt_tokens_details}{cached_tokens},
             action => $r->{headers}{'x-s-action'},
             backend => $r->{headers}{'x-backend'} };
}

my @sessions = map { "m$_" } 1 .. 16;
for my $round (0 .. 1) {
    for my $sid (@sessions) {
        my $r = turn($sid);
        $backend{$sid} = $r->{backend};
        $prev{$sid} = $r->{prompt};
    }
}
my %load;
$load{$_}++ for values %backend;
# the ring's share of each owner depends on its port: two at least
cmp_ok(scalar keys %load, '>=', 2, 'spread over the owners ('
       . join(', ', map { "$_: $load{$_}" } sort keys %load) . ')');

# the session in each slot is saved too, once idle
sleep 3;

my ($gone) = sort { $load{$b} <=> $load{$a} } keys %load;
$t->stop_llama($gone);

my @bad;
my $moved = 0;
for my $sid (@sessions) {
    next unless $backend{$sid} eq $gone;
    my $r = turn($sid);
    $moved++;
    push @bad, "$sid still on $gone" if $r->{backend} eq $gone;
    push @bad, "$sid on $r->{backend}: $r->{action}, $r->{cached} cached of "
               . "$prev{$sid}"
        if $r->{action} ne 'restore' || $r->{cached} < 0.9 * $prev{$sid};
}
is_deeply(\@bad, [], "llama-server $gone down: its $moved sessions restore "
          . 'their files on the other owners') or diag join "\n", @bad;

# the owner comes back (a new llama-server on its port): its sessions
# return to it and restore the state they saved on the others, with the
# turn served there
my %moved = map { $_ => $prev{$_} } grep { $backend{$_} eq $gone } @sessions;
sleep 3;
$t->llama(name => $gone, ctx => 8192, slots => "$dir/slots",
          port => $t->{llama_port}{$gone});
sleep 4;
@bad = ();
for my $sid (sort keys %moved) {
    my $r = turn($sid);
    push @bad, "$sid on $r->{backend}, not back on $gone"
        if $r->{backend} ne $gone;
    push @bad, "$sid: $r->{action}, $r->{cached} cached of $r->{prompt}"
        if $r->{action} ne 'restore' || $r->{cached} < 0.9 * $r->{prompt}
           || $r->{cached} <= $moved{$sid};
}
is_deeply(\@bad, [], "llama-server $gone back: its sessions return and "
          . 'restore the state saved on the other owners (more than they '
          . 'left)') or diag join "\n", @bad;
$t->allow_alerts(qr/connect\(\) failed/);

$t->stop;
done_testing;
