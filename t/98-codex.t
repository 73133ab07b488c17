#!/usr/bin/perl

# Codex through the module: a recorded exchange of the real CLI
# (t/data/codex-exchange.jsonl: Codex 0.171.0, `codex exec`, two
# conversations and the second turn of the first, recorded by
# t/record-responses.mjs) replayed with its own headers and bodies against
# a real llama-server.  Codex's prompt is two developer items and tools,
# no instructions; each item has an id of its own per conversation.  A
# second conversation starts warm from the first one's developer items and
# tools (the Responses API's system prompt, llama_session_warm), where
# without the module llama-server reuses them only while its one slot
# still holds them; the first conversation's next turn finds its cache.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $JSON = $LlamaTest::JSON;

my @recorded;
{
    open my $fh, '<', "$FindBin::Bin/data/codex-exchange.jsonl" or die;
    @recorded = grep { $_->{method} eq 'POST' }
                map { $JSON->decode($_) } grep { /\S/ } <$fh>;
}
is(scalar @recorded, 3, 'the recording: three requests of Codex');

sub replay {
    my ($t, $req, %o) = @_;
    my %h = %{ $req->{headers} };
    delete @h{qw(host content-length connection accept-encoding)};
    my $body = $JSON->decode($JSON->encode($req->{body}));
    $body->{max_output_tokens} = 4;
    $body->{temperature} = 0;
    if ($o{sid}) {
        $h{$_} = $o{sid} for qw(session-id thread-id x-client-request-id);
        $body->{prompt_cache_key} = $o{sid};
        $body->{input}[-1]{content}[0]{text} = "say $o{sid}";
    }
    my ($status, $events, $raw, $res) = $t->stream('/v1/responses', $body,
                                                   headers => \%h);
    my ($done) = grep { ref && ($_->{type} // '') eq 'response.completed' }
                 @$events;
    my $usage = $done ? $done->{response}{usage} : {};
    return { status => $status, raw => $raw,
             action => $res->{headers}{'x-s-action'} // '',
             prompt => $usage->{input_tokens} // 0,
             cached => $usage->{input_tokens_details}{cached_tokens} // 0 };
}

my $t = LlamaTest->new(workers => 2);
$t->llama(np => 2, ctx => 2 * 16384);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m slots=2 store=%%SLOTS%%;',
    server => 'llama_session_warm system;',
    location => 'proxy_read_timeout 600s;
                 add_header X-S-Action $llama_session_action always;',
    slots => 'proxy_read_timeout 600s;',
    extra => 'location /api/ { llama_session_api llama; }'));

my ($a1, $b1, $a2) = @recorded;
my $ra = replay($t, $a1);
is($ra->{status}, 200, 'Codex\'s first conversation: 200') or diag $ra->{raw};
is($ra->{action}, 'fresh', 'it starts fresh (its base made)');
cmp_ok($ra->{prompt}, '>', 4000, "its prompt: $ra->{prompt} tokens");

my $rb = replay($t, $b1);
is($rb->{action}, 'warm', 'a second conversation starts warm');
cmp_ok($rb->{cached}, '>=', 0.9 * $rb->{prompt},
       "from the first one's developer items and tools: $rb->{cached} of "
       . "$rb->{prompt} tokens cached");
# its environment item (folder, shell, date: ~180 tokens) is the first
# one's too: only the user's "say hi" and the template's turn after it
# are computed
cmp_ok($rb->{prompt} - $rb->{cached}, '<', 40,
       'and its environment item: ' . ($rb->{prompt} - $rb->{cached})
       . ' tokens computed');

# two more conversations take the two slots
for my $sid (qw(other-1 other-2)) {
    my $r = replay($t, $b1, sid => $sid);
    is($r->{action}, 'warm', "$sid starts warm too ($r->{cached} cached)");
}

my $r2 = replay($t, $a2);
cmp_ok($r2->{cached}, '>=', $ra->{prompt} - 8,
       "the first conversation's next turn comes back: $r2->{cached} of "
       . "its first $ra->{prompt} tokens cached");
is($r2->{action}, 'restore', 'by a restore');
my $tid = $a1->{headers}{'session-id'};
my $s = $t->get('/api/sessions')->{json}{sessions} // [];
ok((grep { ($_->{id} // '') eq $tid } @$s),
   "known by its session-id header ($tid)") or diag explain $s;
$t->stop;

done_testing;
