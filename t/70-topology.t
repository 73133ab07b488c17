#!/usr/bin/perl

# Many nodes with no shared state, against real llama-servers: three owner
# nodes (nginx with the module and its own llama-server each) and two edge
# nodes (nginx with "llama_session identity": the session's key, no slot)
# that route each session to its owner with "hash $llama_session_key
# consistent".  Clients alternate edges; every returning turn finds its
# cache; stopping one owner moves only its sessions.  The same layout in
# one nginx (an edge server and owner servers) is many llama-servers
# behind one nginx.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my @owners = map { LlamaTest->new(workers => 2) } 1 .. 3;
for my $o (@owners) {
    $o->llama(ctx => 8192);
    $o->nginx($o->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
        upstream => '',
        location => q{
            proxy_read_timeout 300s;
            add_header X-S-Action $llama_session_action always;
            add_header X-S-Key $llama_session_key always;
            add_header X-Owner $server_port always;
        }));
}

my $servers = join "\n", map { "        server 127.0.0.1:$_->{nginx_port} "
                                . "max_fails=1 fail_timeout=2s;" } @owners;
my @edges = map { LlamaTest->new(workers => 2) } 1 .. 2;
for my $e (@edges) {
    $e->nginx(<<"EOF");
    upstream owners {
        zone owners 64k;
        hash \$llama_session_key consistent;
$servers
    }

    server {
        listen 127.0.0.1:%%PORT%%;

        location / {
            llama_session identity;
            proxy_pass http://owners;
            proxy_read_timeout 300s;
            proxy_next_upstream error timeout;
            add_header X-Edge-Key \$llama_session_key always;
        }
    }
EOF
}

my $system = join ' ', map { "Rule $_ of the house." } 1 .. 40;
my (%conv, %owner, %prev);

sub turn {
    my ($sid, $edge) = @_;
    $conv{$sid} //= [ { role => 'system', content => $system },
                      { role => 'user', content => join ' ', map {
                            "Session $sid note $_." } 1 .. 40 } ];
    my $r = $edges[$edge]->post('/v1/chat/completions',
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
             key => $r->{headers}{'x-s-key'},
             edge_key => $r->{headers}{'x-edge-key'},
             owner => $r->{headers}{'x-owner'} };
}

my @sessions = map { "u$_" } 1 .. 24;
my (@bad, @moved_owner);
for my $round (0 .. 2) {
    for my $i (0 .. $#sessions) {
        my $sid = $sessions[$i];
        my $r = turn($sid, ($i + $round) % 2);
        push @bad, "$sid: the edge's key $r->{edge_key}, the owner's $r->{key}"
            if $r->{edge_key} ne $r->{key};
        if (defined $owner{$sid} && $owner{$sid} ne $r->{owner}) {
            push @bad, "$sid moved from $owner{$sid} to $r->{owner}";
        }
        if ($round && $r->{cached} < $prev{$sid} - 4) {
            push @bad, "$sid: $r->{cached} cached of $prev{$sid}";
        }
        $owner{$sid} = $r->{owner};
        $prev{$sid} = $r->{prompt};
    }
}
is_deeply(\@bad, [], '24 sessions, 3 rounds, alternating edges: the edges '
          . 'compute the owners\' keys, each session keeps its owner, every '
          . 'returning turn finds its cache') or diag join "\n", @bad;
my %load;
$load{$_}++ for values %owner;
is(scalar keys %load, 3, 'the sessions spread over the three owners ('
   . join(', ', map { "$_: $load{$_}" } sort keys %load) . ')');

# one owner stops: only its sessions move
my ($gone) = sort { $load{$b} <=> $load{$a} } keys %load;
my ($down) = grep { $_->{nginx_port} == $gone } @owners;
$down->stop_nginx;
@bad = ();
for my $i (0 .. $#sessions) {
    my $sid = $sessions[$i];
    my $r = turn($sid, $i % 2);
    if ($owner{$sid} eq $gone) {
        push @bad, "$sid still on the stopped owner" if $r->{owner} eq $gone;
    } else {
        push @bad, "$sid moved from $owner{$sid} to $r->{owner}"
            if $r->{owner} ne $owner{$sid};
        push @bad, "$sid: $r->{cached} cached of $prev{$sid}"
            if $r->{cached} < $prev{$sid} - 4;
    }
    $prev{$sid} = $r->{prompt};
}
is_deeply(\@bad, [], "owner $gone stopped: its $load{$gone} sessions go "
          . 'elsewhere, the others stay where they were, with their caches')
    or diag join "\n", @bad;

# it comes back: its sessions return to it and find the state they left
# there, a prefix of their conversation now
$down->start_nginx;
# a fixed time: the edges try the owner again after their fail_timeout
# (2 s), which nothing shows before a request goes there
sleep 5;
my ($back, $restored) = (0, 0);
@bad = ();
for my $i (0 .. $#sessions) {
    my $sid = $sessions[$i];
    next unless $owner{$sid} eq $gone;
    my $r = turn($sid, $i % 2);
    $back++ if $r->{owner} eq $gone;
    if ($r->{action} eq 'restore') {
        $restored++;
        push @bad, "$sid restored $r->{cached} of $r->{prompt}"
            if $r->{cached} < $r->{prompt} / 2;
    }
}
is($back, $load{$gone}, 'when the owner is back, its sessions return to it');
cmp_ok($restored, '>', 0, "$restored of them restore the state they left");
is_deeply(\@bad, [], 'a prefix of their conversation, reused')
    or diag join "\n", @bad;

$_->stop for @edges, @owners;
done_testing;
