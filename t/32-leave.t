#!/usr/bin/perl

# A client that leaves at every stage of its request, over HTTP/1.1 and
# HTTP/2, against the fake backend, which is made slow at that stage:
# GET /props, GET /v1/models, GET /slots, the save of the session leaving,
# the restore or the erase of the one coming in, and the inference itself
# (streamed or not), and a new conversation's warm start (the prime of its
# system prompt, the save of its base).  After each: the slot serves the
# next request, no
# request runs as a hit on a slot whose content nobody knows, and every
# saved file holds its own session's text only.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep time);

my $JSON = $LlamaTest::JSON;

my $t = LlamaTest->new(workers => 2);
$t->fake;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    upstream => '',
    server => q{
        listen 127.0.0.1:%%H2%% http2;

        add_header X-S-Action $llama_session_action always;

        llama_session_warm system min=16;
    },
    location => 'proxy_buffering off;'));

my ($curl) = grep { -x } map { "$_/curl" } split /:/, $ENV{PATH};

# a turn of a conversation: its first message, then the text
sub chat_of { LlamaTest::conversation($_[0]) }

# the first turn of a new conversation with a system prompt: a warm start
sub warm_of {
    return { messages => [ { role => 'system',
                             content => 'You answer in one line. ' x 4 },
                           { role => 'user', content => $_[0] } ] };
}

sub ask {
    my ($sid, $text) = @_;
    return $t->post('/v1/chat/completions', chat_of($text // "text of $sid"),
                    headers => { 'X-Session-Id' => $sid });
}

# every file holds the text of its own session, of no other
sub files_own {
    my ($names) = @_;
    for my $f (glob($t->dir . '/slots/*.bin')) {
        my ($base) = $f =~ m{/([^/]+)-[0-9a-f]{24}\.[0-9a-f]{8}\.bin$} or next;
        my $text = $t->read_file($f);
        for my $other (@$names) {
            next if $other eq $base;
            return "$base holds $other" if $text =~ /text of $other\b/;
        }
    }
    return '';
}

sub leave {
    my ($proto, $sid, $after, $warm) = @_;
    my $body = $JSON->encode({ %{ $warm ? warm_of("text of $sid")
                                        : chat_of("text of $sid") },
                               stream => JSON::PP::true });
    if ($proto eq 'h2') {
        my $pid = fork();
        if ($pid == 0) {
            exec $curl, '-s', '-o', '/dev/null', '--http2-prior-knowledge',
                 '--max-time', $after, '-H', "X-Session-Id: $sid",
                 '-H', 'Content-Type: application/json', '--data', $body,
                 "http://127.0.0.1:$t->{h2_port}/v1/chat/completions";
            exit 1;
        }
        waitpid($pid, 0);
        return;
    }
    my $s = $t->raw_open('POST', '/v1/chat/completions', $body,
                         headers => { 'X-Session-Id' => $sid });
    sleep $after;    # a fixed time: the client leaves during the stage
    close $s;
}

my @stages = (
    [ 'GET /props',     { props => { delay_ms => 800 } },    'unknown' ],
    [ 'GET /v1/models', { models => { delay_ms => 800 } },   'unknown' ],
    [ 'GET /slots',     { slots => { delay_ms => 800 } },    'swap' ],
    [ 'save',           { save => { delay_ms => 800 } },     'swap' ],
    [ 'restore',        { restore => { delay_ms => 800 } },  'restore' ],
    [ 'erase',          { erase => { delay_ms => 800 } },    'erase' ],
    [ 'inference',      { completion => { delay_ms => 800 } }, 'swap' ],
    [ 'a stream',       { completion => { chunks => 8, chunk_ms => 150 } },
                        'swap' ],
    [ 'the prime',      { completion => { delay_ms => 800,
                                          match => '"max_tokens":1,' } },
                        'warm' ],
    [ 'the base\'s save', { save => { delay_ms => 800, match => 'base-' } },
                        'warm' ],
);

my @names;
my $n = 0;

for my $proto ('http/1.1', 'h2') {
    SKIP: {
        skip 'no curl for HTTP/2', scalar(@stages) * 4
            if $proto eq 'h2' && !$curl;

        for my $st (@stages) {
            my ($stage, $script, $how) = @$st;
            $n++;
            my ($a, $b) = ("a$n", "b$n");
            push @names, $a, $b;

            ask($a);
            ask($b);                                   # a saved, b in slot
            if ($how eq 'unknown') {
                # the zone's fingerprint is learned again after a restart
                $t->stop_proc('fake');
                $t->fake(port => $t->{llama_port}{fake});
                ask("w$n");
                push @names, "w$n";
                $t->stop_proc('fake');
                $t->fake(port => $t->{llama_port}{fake});
            }

            my $leaver = $how eq 'erase' || $how eq 'warm' ? "new$n" : $a;
            push @names, $leaver;
            $t->fake_script($script);
            leave($proto, $leaver, 0.3, $how eq 'warm');
            # a fixed time: longer than the stage's 800 ms, whose end in
            # the backend leaves no trace (this site has no API location)
            sleep 1;
            $t->fake_script({});

            my $r = ask($b, "text of $b again");
            is($r->{status}, 200,
               "$proto, left during $stage: the next request is served");
            if ($how eq 'restore' || $how eq 'erase' || $how eq 'warm') {
                isnt($r->{headers}{'x-s-action'}, 'hit',
                     "$proto, left during $stage: no hit on the slot");
            } else {
                ok(1, "$proto, left during $stage: the slot's content is "
                      . 'known as before');
            }
            is(files_own(\@names), '',
               "$proto, left during $stage: every file is its session's");
            # a save that llama-server carries on after its client left
            # may write its temporary file after the module deleted it: the
            # next start deletes it, the next save of the session reuses it
            ok($stage =~ /save/ || !glob($t->dir . '/slots/*.tmp'),
               "$proto, left during $stage: no temporary file stays");
            if ($stage =~ /save/) {
                # as the next start would: the next stages look for theirs
                # (a fixed time: the late write would have happened by then)
                sleep 1;
                unlink glob($t->dir . '/slots/*.tmp');
            }
        }
    }
}

$t->stop;
done_testing;
