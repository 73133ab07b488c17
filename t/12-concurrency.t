#!/usr/bin/perl

# 20 concurrent clients over 4 sessions, nginx with 4 workers, a real
# llama-server with one slot: all succeed, and the cache figures show that
# no request ever ran while the slot held another session: each session
# starts fresh once, and every later request finds its session's whole
# prefix.  Nothing is stuck afterwards.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 4);
$t->llama;

$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    upstream => 'keepalive 8;',
    listen => 'reuseport',
    location => q{
        llama_session_wait_timeout 120s;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_read_timeout 300s;
        add_header X-S-Action $llama_session_action always;
        add_header X-S-Wait $llama_session_wait_ms always;
    }));

my $system = join ' ', map { "Policy $_ applies to every answer." } 1 .. 40;
my @sessions = map { "s$_" } 1 .. 4;
my %block = map { my $s = $_;
                  $s => join(' ', map { "Session $s remembers item $_ well." }
                                  1 .. 60) } @sessions;

sub body {
    my ($sid, $q) = @_;
    return { messages => [ { role => 'system', content => $system },
                           { role => 'user', content => "$block{$sid} Q$q" } ],
             max_tokens => 2, temperature => 0 };
}

# 20 clients, 5 per session, 2 requests each, all sent at once
my @h;
for my $c (0 .. 19) {
    my $sid = $sessions[$c % 4];
    for my $q (1 .. 2) {
        push @h, [ $sid, $t->async_post('/v1/chat/completions',
                                        body($sid, $c * 10 + $q),
                                        headers => { 'X-Session-Id' => $sid }) ];
    }
}

my @res = map { [ $_->[0], $t->async_wait($_->[1], 300) ] } @h;

is(scalar(grep { $_->[1]{status} == 200 } @res), 40,
   'all 40 requests of the 20 clients succeeded');

my (%fresh, @bad);
for my $r (@res) {
    my ($sid, $x) = @$r;
    next unless $x->{json};
    my $u = $x->{json}{usage};
    my $action = $x->{headers}{'x-s-action'} // '';
    my $cached = $u->{prompt_tokens_details}{cached_tokens};

    if ($action eq 'fresh' || $action eq 'warm') {
        # a session's first request: from nothing, or from the shared
        # system prompt alone (a third of the prompt), never from another
        # session's block
        $fresh{$sid}++;
        push @bad, "$sid $action but $cached cached of $u->{prompt_tokens}"
            if $cached > $u->{prompt_tokens} / 2;
    } else {
        # the session's system prompt and block: all but the question and
        # the template around it (the shared system prompt alone is less
        # than a third of the prompt)
        push @bad, "$sid $action: $cached cached of $u->{prompt_tokens}"
            if $cached < $u->{prompt_tokens} - 30;
    }
}

is_deeply(\%fresh, { map { $_ => 1 } @sessions },
          'each session started fresh or warm exactly once');
is_deeply(\@bad, [], 'every other request found its own session in the '
          . 'slot (no request ran on another session\'s cache)')
    or diag join "\n", @bad;

my @actions = map { $_->[1]{headers}{'x-s-action'} } @res;
ok((grep { $_ eq 'restore' } @actions), 'sessions were restored');
ok((grep { $_ eq 'hit' } @actions), 'and waiting requests of the session in '
   . 'the slot went first (hits)');

# nothing stuck: every session answers at once
for my $sid (@sessions) {
    my $r = $t->post('/v1/chat/completions', body($sid, 999),
                     headers => { 'X-Session-Id' => $sid });
    is($r->{status}, 200, "$sid answers afterwards");
    cmp_ok($r->{headers}{'x-s-wait'}, '<', 1000,
           "$sid did not wait behind anything stuck");
}

$t->stop;
done_testing;
