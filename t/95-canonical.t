#!/usr/bin/perl

# Claude Code's billing header (canon.c, llama_session_canonical): the
# first system block "x-anthropic-billing-header: cc_version=V.xyz;
# cc_entrypoint=sdk-cli; cch=...;" differs per conversation (the
# version's fourth part) and per request (cch=).  The module makes those
# characters "0", in what it hashes and in what it proxies, so that every
# conversation of one system prompt starts warm from it; off, a second
# conversation starts fresh.  Bodies in memory and in nginx's temporary
# file.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $JSON = $LlamaTest::JSON;
my $system = 'You are an interactive CLI tool that helps users. ' x 40;

sub ask {
    my ($t, $sid, $suffix, %o) = @_;
    my $billing = "x-anthropic-billing-header: cc_version=2.1.197.$suffix; "
                . 'cc_entrypoint=sdk-cli;' . ($o{cch} ? " cch=$o{cch};" : '');
    my $r = $t->post('/v1/messages',
                     { model => 'claude', max_tokens => 8,
                       system => [ { type => 'text', text => $billing },
                                   { type => 'text', text => $system
                                     . ($o{pad} // '') } ],
                       messages => [ { role => 'user',
                                       content => "hello from $sid" } ] },
                     headers => { 'X-Claude-Code-Session-Id' => $sid });
    die "$sid: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    return $r->{headers}{'x-s-action'};
}

# the billing block of what the model got: Anthropic's request became a
# chat completion (anthropic.c), its system blocks one system message,
# "cch=" normalised to "fffff" as llama-server's own conversion does
sub proxied {
    my ($t, $sid) = @_;
    my ($c) = grep { $_->{path} eq '/v1/chat/completions'
                     && ($_->{body} // '') =~ /hello from $sid/ }
              @{ $t->fake_calls };
    my $text = $c ? $JSON->decode($c->{body})->{messages}[0]{content} : '';
    $text =~ s/You are an interactive CLI tool.*//s;
    return $text;
}

for my $mode (qw(on off)) {
    my $t = LlamaTest->new(workers => 1);
    $t->fake;
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
        upstream => '',
        server => "llama_session_warm system min=64;
                   llama_session_canonical $mode;
                   client_body_buffer_size 16k;",
        location => 'add_header X-S-Action $llama_session_action always;'));

    is(ask($t, 'conv-a', '6c5', cch => 'a1b2c'), 'fresh',
       "$mode: the first conversation starts fresh");
    my $second = ask($t, 'conv-b', 'ec7', cch => '9f8e7');

    if ($mode eq 'on') {
        is($second, 'warm', 'on: a second conversation starts warm from it');
        is(proxied($t, 'conv-a'),
           'x-anthropic-billing-header: cc_version=2.1.197.000; '
           . 'cc_entrypoint=sdk-cli; cch=fffff;',
           'on: llama-server gets the canonical header');
        is(proxied($t, 'conv-b'), proxied($t, 'conv-a'),
           'on: the same for both conversations');

        # a body nginx writes to its temporary file: rewritten there
        my $big = ' ' . ('more rules. ' x 3000);
        ask($t, 'conv-c', '1ab', cch => 'zz9', pad => $big);
        ok($t->log_lines(qr/a client request body is buffered to a temporary file/),
           'on: a body in a file');
        is(ask($t, 'conv-d', '2cd', cch => 'q7w', pad => $big), 'warm',
           'on: its next conversation starts warm too');
        like(proxied($t, 'conv-d'), qr/cc_version=2\.1\.197\.000; cc_entrypoint=sdk-cli; cch=000;$/,
             'on: and its proxied body has the canonical header');

        # review 3: only Claude Code's first system block of /v1/messages;
        # the same line anywhere else is the client's text
        my $quote = 'x-anthropic-billing-header: cc_version=2.1.197.6c5; '
                  . 'cc_entrypoint=sdk-cli; cch=ab12c;';
        my $r = $t->post('/v1/messages',
                         { model => 'claude', max_tokens => 8,
                           system => [ { type => 'text', text => $system },
                                       { type => 'text', text => $quote } ],
                           messages => [ { role => 'user',
                                           content => "quote-1 $quote" } ] },
                         headers => { 'X-Claude-Code-Session-Id' => 'q1' });
        is($r->{status}, 200, 'on: a request that quotes the header');
        my ($c) = grep { ($_->{body} // '') =~ /quote-1/ } @{ $t->fake_calls };
        my $body = $c ? $JSON->decode($c->{body}) : {};
        my $all = join "\n", map { ref $_->{content} ? $JSON->encode($_->{content})
                                                      : $_->{content} // '' }
                             @{ $body->{messages} // [] };
        like($all, qr/quote-1 \Q$quote\E/,
             'on: a user message that quotes it reaches llama-server unchanged');
        # (its cch= becomes fffff: llama-server's own conversion does that
        # to every system block that starts with the header)
        like($all, qr/users\. \s*x-anthropic-billing-header: cc_version=2\.1\.197\.6c5;/,
             'on: so does a later system block that starts with it');

        $r = $t->post('/v1/chat/completions',
                      { max_tokens => 8,
                        messages => [ { role => 'system', content => $quote },
                                      { role => 'user', content => 'quote-2' } ] },
                      headers => { 'X-Session-Id' => 'q2' });
        is($r->{status}, 200, 'on: a chat completion with it as its system');
        ($c) = grep { ($_->{body} // '') =~ /quote-2/ } @{ $t->fake_calls };
        like($c ? $c->{body} : '', qr/\Q$quote\E/,
             'on: another endpoint\'s body is not rewritten');
    } else {
        is($second, 'fresh', 'off: a second conversation starts fresh');
        like(proxied($t, 'conv-b'), qr/cc_version=2\.1\.197\.ec7; cc_entrypoint=sdk-cli; cch=fffff;/,
             'off: the header as the client sent it');
    }

    $t->stop;
}

done_testing;
