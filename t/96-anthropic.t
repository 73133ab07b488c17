#!/usr/bin/perl

# Anthropic's Messages API on several slots (anthropic.c): /v1/messages
# is translated into a chat completion pinned to the session's slot, and
# the reply back into Anthropic's shape, whole and streamed.  Played with
# the official @anthropic-ai/sdk: six conversations on a llama-server of
# four slots, each returning turn cached; count_tokens; and, on the fake
# backend, what llama-server is sent (system blocks, tool_use, tool_result,
# thinking, images, tools, tool_choice, stop_sequences) and the SDK's
# reading of a reply with thinking and two tool calls, streamed and whole,
# and of an error.  With llama_session_anthropic off, four slots refuse.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $JSON = $LlamaTest::JSON;

my $modules = `$LlamaTest::ROOT/rig/npm-clients.sh 2>/dev/null`;
chomp $modules;
-d $modules or BAIL_OUT("rig/npm-clients.sh failed: run 'make rig'");

# the SDK's side: a script of its own, beside the packages
my $sdk = <<'JS';
import Anthropic from '@anthropic-ai/sdk';
const [mode, base] = process.argv.slice(2);
const client = (id) => new Anthropic({ baseURL: base, apiKey: 'none',
    maxRetries: 0, defaultHeaders: { 'X-Claude-Code-Session-Id': id } });
const notes = (who) => Array.from({ length: 30 },
    (_, i) => `${who} keeps note ${i + 1}.`).join(' ');
const tools = [{ name: 'read_file', description: 'Reads a file.',
    input_schema: { type: 'object', properties: { path: { type: 'string' } },
                    required: ['path'] } }];
const out = [];

async function ask(c, body, stream) {
    if (stream) {
        const s = c.messages.stream(body);
        const events = [];
        let start = null;
        s.on('streamEvent', (e) => {
            events.push(e.type);
            if (e.type === 'message_start') {
                start = JSON.parse(JSON.stringify(e.message.usage));
            }
        });
        const m = await s.finalMessage();
        return { m, events, start };
    }
    return { m: await c.messages.create(body), events: [] };
}

function brief({ m, events, start }, id, stream) {
    return { id, stream, start, type: m.type, role: m.role,
             stop: m.stop_reason,
             blocks: m.content.map((b) => b.type), content: m.content,
             input: m.usage.input_tokens,
             cached: m.usage.cache_read_input_tokens ?? 0,
             output: m.usage.output_tokens, events, msgid: m.id };
}

if (mode === 'slots') {
    const convs = ['c1', 'c2', 'c3', 'c4', 'c5', 'c6'].map((id, i) => ({
        id, c: client(`session-${id}`), stream: i % 2 === 0,
        system: i % 3 === 0 ? 'You answer briefly.'
              : [{ type: 'text', text: 'You answer briefly.',
                   cache_control: { type: 'ephemeral' } }],
        messages: [{ role: 'user', content: notes(id) }] }));
    for (const round of [1, 2]) {
        for (const v of convs) {
            const r = await ask(v.c, { model: 'any', system: v.system,
                messages: v.messages, tools, max_tokens: 3, temperature: 0,
                metadata: { user_id: 'user-1' } }, v.stream);
            const text = r.m.content.filter((b) => b.type === 'text')
                                    .map((b) => b.text).join('') || '.';
            v.messages.push({ role: 'assistant', content: text },
                            { role: 'user', content: `More, ${v.id}.` });
            out.push({ round, ...brief(r, v.id, v.stream) });
        }
    }
    const n = await client('session-c1').messages.countTokens({
        model: 'any', messages: [{ role: 'user', content: notes('c1') }] });
    out.push({ count: n.input_tokens });
} else if (mode === 'shapes') {
    const c = client('shapes');
    const body = { model: 'any', max_tokens: 64,
                   messages: [{ role: 'user', content: 'Read two files.' }],
                   tools };
    out.push(brief(await ask(c, body, true), 'streamed', true));
    out.push(brief(await ask(c, body, false), 'whole', false));
} else if (mode === 'error') {
    try {
        await client('err').messages.create({ model: 'any', max_tokens: 4,
            messages: [{ role: 'user', content: 'hi' }] });
        out.push({ error: 'none' });
    } catch (e) {
        out.push({ status: e.status, name: e.constructor.name,
                   message: e.error?.error?.message ?? e.message,
                   type: e.error?.error?.type ?? e.error?.type });
    }
}
console.log(JSON.stringify(out));
JS

sub sdk {
    my ($t, $mode) = @_;
    my $dir = $t->dir . '/sdk';
    unless (-d $dir) {
        mkdir $dir or die;
        symlink $modules, "$dir/node_modules" or die;
        open my $fh, '>', "$dir/sdk.mjs" or die;
        print $fh $sdk;
        close $fh;
    }
    my $out = `node $dir/sdk.mjs $mode http://127.0.0.1:$t->{nginx_port} 2>&1`;
    my $r = eval { $JSON->decode((split /\n/, $out)[-1]) };
    ok($r, "the SDK ran ($mode)") or diag $out;
    return $r // [];
}

# --- six conversations on four slots of a real llama-server -------------

my $t = LlamaTest->new(workers => 2);
$t->llama(np => 4, ctx => 4 * 4096);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m slots=4 store=%%SLOTS%%;',
    location => 'proxy_read_timeout 300s;',
    slots => 'proxy_read_timeout 300s;',
    extra => 'location /api/ { llama_session_api llama; }'));

my $turns = sdk($t, 'slots');
my ($count) = map { $_->{count} } grep { exists $_->{count} } @$turns;
my %first = map { $_->{id} => $_ } grep { ($_->{round} // 0) == 1 } @$turns;
my @again = grep { ($_->{round} // 0) == 2 } @$turns;

is(scalar @again, 6, 'six conversations, two turns each');
for my $r (grep { $_->{round} } @$turns) {
    my $how = $r->{stream} ? 'streamed' : 'whole';
    ok($r->{type} eq 'message' && $r->{role} eq 'assistant'
       && $r->{stop} =~ /^(end_turn|max_tokens)$/ && $r->{msgid} =~ /^msg_/
       && $r->{output} >= 1,
       "$r->{id} turn $r->{round} ($how): an Anthropic message, stop "
       . "$r->{stop}, $r->{output} tokens out");
}
for my $r (grep { $_->{stream} } @again) {
    is_deeply([ grep { !/^content_block_delta$/ } @{ $r->{events} } ],
              [ qw(message_start content_block_start content_block_stop
                   message_delta message_stop) ],
              "$r->{id}: the stream's events in Anthropic's order")
        or diag explain $r->{events};
}
for my $r (grep { $_->{stream} && $_->{round} } @$turns) {
    my $st = $r->{start} // {};
    my $in = ($st->{input_tokens} // 0) + ($st->{cache_read_input_tokens} // 0);
    ok($in > 100 && $in == $r->{input} + $r->{cached},
       "$r->{id} turn $r->{round}: message_start counts the prompt's "
       . "$in tokens ($st->{input_tokens} evaluated, "
       . "$st->{cache_read_input_tokens} from the cache), as llama-server's "
       . "own /v1/messages") or diag explain $r;
}
for my $r (@again) {
    my $f = $first{$r->{id}};
    my $prompt = $f->{input} + $f->{cached};
    cmp_ok($r->{cached}, '>=', $prompt - 1,
           "$r->{id} returns after others took its slot: "
           . "$r->{cached} of its first $prompt tokens read from the cache");
}
ok($t->log_lines(qr/in "session-c1" restored|session-c1.*restored/),
   'a conversation was saved and restored on four slots');
ok(!$t->log_lines(qr/cannot pin/), 'no request refused');
# the rig's model attends to the whole context: a client's swap saves the
# slot as it is (t/92-reprime.t), and no turn failed to be read
ok(!$t->log_lines(qr/re-primed "session-c\d-\w+" on slot \d of zone "llama" before its save/),
   'full attention: the swaps of Anthropic conversations save the slot as '
   . 'it is, as a chat one\'s');
ok(!$t->log_lines(qr/is saved without a re-prime/), 'no turn file failed');
cmp_ok($count // 0, '>', 100, "count_tokens passes on: $count tokens");

# the llama-server slots the sessions ran on: each of its own
my $slots = $t->get('/api/sessions/current')->{json}{slots} // [];
my %held = map { $_->{session}{id} => 1 } grep { $_->{session} } @$slots;
is(scalar keys %held, 4, 'four sessions hold the four slots, one each')
    or diag explain $slots;
$t->stop;

# --- the translation, both ways, on the fake backend ---------------------

my @events = (
    { choices => [ { index => 0, delta => { role => 'assistant',
                                            content => undef } } ] },
    { choices => [ { index => 0, delta => { reasoning_content => 'Two ' } } ] },
    { choices => [ { index => 0, delta => { reasoning_content => 'files.' } } ] },
    { choices => [ { index => 0, delta => { content => 'Reading.' } } ] },
    { choices => [ { index => 0, delta => { tool_calls => [ { index => 0,
          id => 'call_a', type => 'function',
          function => { name => 'read_file', arguments => '{"pa' } } ] } } ] },
    { choices => [ { index => 0, delta => { tool_calls => [ { index => 0,
          function => { arguments => 'th":"a.txt"}' } } ] } } ] },
    { choices => [ { index => 0, delta => { tool_calls => [ { index => 1,
          id => 'call_b', type => 'function',
          function => { name => 'read_file',
                        arguments => '{"path":"b.txt"}' } } ] } } ] },
    { choices => [ { index => 0, finish_reason => 'tool_calls',
                     delta => {} } ],
      timings => { cache_n => 40, prompt_n => 12, predicted_n => 9 },
      usage => { prompt_tokens => 52, completion_tokens => 9 } },
);
my $reply = { id => 'chatcmpl-xyz', model => 'tiny', object => 'chat.completion',
              choices => [ { index => 0, finish_reason => 'tool_calls',
                  message => { role => 'assistant', content => 'Reading.',
                               reasoning_content => 'Two files.',
                               tool_calls => [
                  { id => 'call_a', type => 'function', function =>
                    { name => 'read_file', arguments => '{"path":"a.txt"}' } },
                  { id => 'call_b', type => 'function', function =>
                    { name => 'read_file', arguments => '{"path":"b.txt"}' } }
                  ] } } ] };

$t = LlamaTest->new(workers => 1);
$t->fake(np => 2, script => { completion => { events => \@events,
                                              reply => $reply } });
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m slots=2 store=%%SLOTS%%;',
    server => 'llama_session_warm system min=64;
               client_max_body_size 16m;',
    location => 'add_header X-S-Action $llama_session_action always;'));

my ($s, $w) = @{ sdk($t, 'shapes') };
my $want = [ { type => 'thinking', thinking => 'Two files.', signature => '' },
             { type => 'text', text => 'Reading.' },
             { type => 'tool_use', id => 'call_a', name => 'read_file',
               input => { path => 'a.txt' } },
             { type => 'tool_use', id => 'call_b', name => 'read_file',
               input => { path => 'b.txt' } } ];
for my $r ($s, $w) {
    is_deeply($r->{content}, $want,
              "$r->{id}: thinking, text and two tool calls, as the SDK "
              . 'reads them') or diag explain $r->{content};
    is($r->{stop}, 'tool_use', "$r->{id}: stop_reason tool_use");
}
is($s->{cached}, 40, 'streamed: cache_read_input_tokens from the cache');
is($s->{input}, 12, 'streamed: input_tokens the evaluated ones');

# what llama-server got: a chat completion, pinned
my $msgs = [
    { role => 'user', content => [
        { type => 'text', text => 'Look:' },
        { type => 'image', source => { type => 'base64',
                                       media_type => 'image/png',
                                       data => 'iVBORw0K' } } ] },
    { role => 'assistant', content => [
        { type => 'thinking', thinking => 'I should read it.',
          signature => 'sig' },
        { type => 'text', text => 'Reading.' },
        { type => 'tool_use', id => 'toolu_1', name => 'read_file',
          input => { path => 'a.txt' } } ] },
    { role => 'user', content => [
        { type => 'tool_result', tool_use_id => 'toolu_1',
          content => [ { type => 'text', text => 'alpha ' },
                       { type => 'text', text => 'beta' } ] },
        { type => 'tool_result', tool_use_id => 'toolu_2',
          content => 'gamma' } ] },
];
my $r = $t->post('/v1/messages',
                 { model => 'any', max_tokens => 5, stop_sequences => ['END'],
                   tool_choice => { type => 'any' }, top_k => 3,
                   thinking => { type => 'enabled', budget_tokens => 99 },
                   system => [ { type => 'text', text =>
                       'x-anthropic-billing-header: cc_version=2.1.1.abc; '
                       . 'cc_entrypoint=cli; cch=1a2b3;' },
                     { type => 'text', text => ' Be brief.',
                       cache_control => { type => 'ephemeral' } } ],
                   tools => [ { name => 'read_file',
                                input_schema => { type => 'object' } } ],
                   messages => $msgs },
                 headers => { 'X-Session-Id' => 'translated' });
is($r->{status}, 200, 'a request with every kind of block: 200');
is($r->{json}{type}, 'message', 'an Anthropic message');
my ($call) = grep { $_->{path} eq '/v1/chat/completions'
                    && ($_->{body} // '') =~ /alpha/ } @{ $t->fake_calls };
my $sent = $call ? $JSON->decode($call->{body}) : {};
is_deeply($sent->{messages}, [
    { role => 'system', content => 'x-anthropic-billing-header: '
      . 'cc_version=2.1.1.000; cc_entrypoint=cli; cch=fffff; Be brief.' },
    { role => 'user', content => [
        { type => 'text', text => 'Look:' },
        { type => 'image_url',
          image_url => { url => 'data:image/png;base64,iVBORw0K' } } ] },
    { role => 'assistant', content => [ { type => 'text', text => 'Reading.' } ],
      tool_calls => [ { id => 'toolu_1', type => 'function',
                        function => { name => 'read_file',
                                      arguments => '{"path":"a.txt"}' } } ],
      reasoning_content => 'I should read it.' },
    { role => 'tool', tool_call_id => 'toolu_1', content => 'alpha beta' },
    { role => 'tool', tool_call_id => 'toolu_2', content => 'gamma' },
], 'llama-server gets the messages as its own conversion makes them')
    or diag explain $sent->{messages};
is_deeply($sent->{tools}, [ { type => 'function', function =>
              { name => 'read_file', description => '',
                parameters => { type => 'object' } } } ], 'the tools');
is($sent->{tool_choice}, 'required', 'tool_choice any: required');
is_deeply($sent->{stop}, ['END'], 'stop_sequences: stop');
is($sent->{thinking_budget_tokens}, 99, 'thinking: its budget');
is($sent->{top_k}, 3, 'sampling parameters as they are');
is($sent->{model}, 'any', 'the model (router mode routes by it)');
like($call->{body} // '', qr/,"id_slot":[01]\}$/, 'pinned to a slot');

# a second conversation of one system prompt starts warm, on two slots:
# the base is primed as a chat completion, pinned (llama-server's own
# /v1/messages could not be)
my $system = 'You are a careful agent. ' x 30;
my @warm = map {
    $t->post('/v1/messages', { model => 'any', max_tokens => 4,
                               system => $system, messages => [
                                   { role => 'user', content => "I am $_" } ] },
             headers => { 'X-Claude-Code-Session-Id' => "warm-$_" })
} qw(a b);
is($warm[0]{headers}{'x-s-action'}, 'fresh', 'the first conversation: fresh');
is($warm[1]{headers}{'x-s-action'}, 'warm', 'the second starts warm');
my @prime = grep { ($_->{body} // '') =~ /careful agent/
                   && ($_->{body} // '') !~ /I am/ } @{ $t->fake_calls };
ok(@prime && !grep({ $_->{path} ne '/v1/chat/completions'
                     || $_->{body} !~ /"id_slot":\d+\}$/ } @prime),
   'its base was primed as a pinned chat completion')
    or diag explain \@prime;

# a failure of llama-server, as the SDK sees it
$t->fake_script({ completion => { status => 500 } });
my ($e) = @{ sdk($t, 'error') };
is($e->{status}, 500, 'an error: its status');
is($e->{type}, 'api_error', 'Anthropic\'s error type');
is($e->{message}, 'scripted failure', 'llama-server\'s message');

# a stream to a client that does not read keeps to nginx's flow control:
# the worker holds its few buffers, not the translated reply
$t->fake_script({ completion => { chunks => 20000, chunk_ms => 0,
                                  chunk_bytes => 2000 } });
my $before = $t->workers_kb;
my $sock = $t->raw_open('POST', '/v1/messages',
    $JSON->encode({ model => 'any', max_tokens => 9, stream => \1,
                    messages => [ { role => 'user', content => 'x' } ] }),
    headers => { 'X-Session-Id' => 'slow-reader' });
my $grew = 0;
$t->wait_for(sub {
    my $after = $t->workers_kb;
    $grew = $after - $before;
    my $sl = $JSON->decode($t->{http}->get(
        'http://127.0.0.1:' . $t->{llama_port}{fake} . '/slots')->{content});
    return !(grep { $_->{is_processing} } @$sl) || $grew > 16 * 1024;
}, 5);
SKIP: {
    skip 'memory figures under ASan or valgrind are the tool\'s', 1
        if $ENV{ASAN_OPTIONS} || $ENV{TEST_NGINX_VALGRIND};
    ok($grew < 8 * 1024, 'a stream of 20,000 events (40 MB) to a client that '
       . 'does not read: the workers grew by ' . int($grew / 1024) . ' MB (< 8)');
}
my $got = '';
$sock->blocking(1);
while (sysread($sock, my $buf, 65536)) { $got .= $buf; }
close $sock;
my $deltas = () = $got =~ /event: content_block_delta/g;
is($deltas, 20000, "then it reads the whole stream: $deltas deltas");
like($got, qr/event: message_stop\ndata: \{"type":"message_stop"\}\n\n/,
     'to its message_stop');

# a hostile body: three million empty arrays, refused before any tree
$before = $t->workers_kb;
$r = $t->post('/v1/messages', '{"model":"m","max_tokens":4,"messages":['
                              . join(',', ('[]') x 3_000_000) . ']}',
              headers => { 'X-Session-Id' => 'arrays',
                           'Content-Type' => 'application/json' });
is($r->{status}, 400, 'a body of three million empty arrays: 400');
like($r->{json}{error}{message} // '', qr/too many JSON values/, 'said so');
my $after = $t->workers_kb;
ok($after - $before < 64 * 1024,
   'the workers grew by ' . int(($after - $before) / 1024) . ' MB (< 64)');

# linear time, asserted on the workers' CPU: each size is sent REPS times
# and the times summed, since one request is a few clock ticks (10 ms).
# One session per size, its first request not counted: it takes the slot,
# whose save of the previous session (re-primed from that session's own,
# larger, prompt) would count.  The bound is on the larger size, with a
# wide margin on both sides: the ratio of the two sizes, printed, is too
# noisy to assert (one CI run measured 5.5 for 0.02 s and 0.11 s, where
# linear is 4 and the quadratic builds gave 13)
my $slow = $ENV{ASAN_OPTIONS} ? 3 : 1;     # AddressSanitizer: 3 to 4 times

sub cpu_of {
    my ($what, $n, $reps, $body) = @_;
    my ($spent, $ok) = (0, 0);
    for my $i (0 .. $reps) {
        my $c0 = $t->workers_cpu;
        my $r = $t->post('/v1/messages', $body->($n),
                         headers => { 'X-Session-Id' => "$what-$n" });
        $spent += $t->workers_cpu - $c0 if $i;
        $ok++ if $r->{status} == 200;
    }
    is($ok, $reps + 1, ($reps + 1) . " messages of $n $what: 200");
    return $spent;
}

# an assistant message of many thinking blocks: its reasoning is joined in
# linear time (each block was appended after a strlen() of the whole
# reasoning so far: quadratic)
my $thinking = sub {
    my ($n) = @_;
    return { model => 'any', max_tokens => 4, messages => [
        { role => 'user', content => 'think' },
        { role => 'assistant', content => [ map { { type => 'thinking',
              thinking => ('t' x 150) . $_ } } 1 .. $n ] },
        { role => 'user', content => 'and?' } ] };
};
my %spent = map { $_ => cpu_of('thinking blocks', $_, 4, $thinking) }
            7500, 30000;
my $ratio = $spent{30000} / ($spent{7500} || 0.01);
note(sprintf('four times the blocks took %.1f times the CPU (%.2f s, %.2f s '
             . 'for 4 each)', $ratio, $spent{7500}, $spent{30000}));
SKIP: {
    skip 'CPU figures under valgrind are the tool\'s', 1
        if $ENV{TEST_NGINX_VALGRIND};
    # 0.3 to 0.5 s here; a build that appends after a strlen(): 4.3 s
    ok($spent{30000} < 2.4 * $slow,
       sprintf('4 messages of 30,000 thinking blocks took %.2f s of CPU '
               . '(< %.1f)', $spent{30000}, 2.4 * $slow));
}

# and a user message of many tool results: each a tool message after it,
# in linear time too (taken off the front of the list, which was counted
# again for each)
my $results = sub {
    my ($n) = @_;
    return { model => 'any', max_tokens => 4, messages => [
        { role => 'user', content => 'read' },
        { role => 'user', content => [ map { { type => 'tool_result',
              tool_use_id => "t$_", content => 'r' } } 1 .. $n ] } ] };
};
%spent = map { $_ => cpu_of('tool results', $_, 5, $results) } 5000, 20000;
$ratio = $spent{20000} / ($spent{5000} || 0.01);
note(sprintf('four times the results took %.1f times the CPU (%.2f s, %.2f '
             . 's for 5 each)', $ratio, $spent{5000}, $spent{20000}));
SKIP: {
    skip 'CPU figures under valgrind are the tool\'s', 1
        if $ENV{TEST_NGINX_VALGRIND};
    # 0.2 to 0.25 s here; a build that counts the list for each: 3.1 s
    ok($spent{20000} < 1.5 * $slow,
       sprintf('5 messages of 20,000 tool results took %.2f s of CPU '
               . '(< %.1f)', $spent{20000}, 1.5 * $slow));
}

# a body that is not Anthropic's
$t->fake_script({});
$r = $t->post('/v1/messages', { model => 'any', messages => 'hi' },
              headers => { 'X-Session-Id' => 'bad' });
is($r->{status}, 400, 'messages not an array: 400');
is($r->{json}{type}, 'error', 'in Anthropic\'s error shape');
is($r->{json}{error}{type}, 'invalid_request_error', 'of its type');

# a member twice: the module and llama-server would read two requests
$r = $t->request('POST', '/v1/messages',
                 body => '{"model":"a","max_tokens":4,"messages":[{"role":'
                        . '"user","content":"hi"}],"system":"x","system":"y"}',
                 headers => { 'X-Session-Id' => 'dup',
                              'Content-Type' => 'application/json' });
is($r->{status}, 400, 'a member twice: 400');
like($r->{json}{error}{message} // '', qr/member twice/, 'said so');
$t->stop;

# --- off: llama-server's own /v1/messages, which cannot be pinned ---------

$t = LlamaTest->new(workers => 1);
$t->fake(np => 2);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m slots=2 store=%%SLOTS%%;',
    server => 'llama_session_anthropic off;'));
$r = $t->post('/v1/messages', { model => 'm', max_tokens => 4,
                                messages => [ { role => 'user',
                                                content => 'hi' } ] },
              headers => { 'X-Session-Id' => 'native' });
is($r->{status}, 501, 'off, with two slots: 501');
like($r->{json}{error}{message} // '', qr/llama_session_anthropic on/,
     'with the way out');
$t->stop;

done_testing;
