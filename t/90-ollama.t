#!/usr/bin/perl

# Ollama's API in front of llama-server (llama_session_ollama on), played
# with the official ollama JavaScript client (examples/clients/ollama.mjs):
# chat streamed (Ollama's default) and not, generate, version, tags; two
# conversations on one slot, each returning turn finds its cache (its
# prompt_eval_count, the tokens evaluated, is small).  Then plain HTTP for
# the rest: NDJSON lines, the last one's fields, /api/ps, /api/show,
# GET and HEAD /, and Ollama-style errors for bad bodies.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $modules = `$LlamaTest::ROOT/rig/npm-clients.sh 2>/dev/null`;
chomp $modules;
-d "$modules/ollama" or BAIL_OUT("rig/npm-clients.sh failed: run 'make rig'");

my $t = LlamaTest->new(workers => 2);
$t->llama(np => 1, ctx => 8192);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    location => q{
        llama_session_ollama on;
        proxy_buffering off;
        proxy_read_timeout 300s;
        add_header X-S-Action $llama_session_action always;
    },
    extra => q{
        location = /metrics {
            llama_session_metrics;
        }
    }));

my $dir = $t->dir . '/clients';
mkdir $dir;
system('cp', "$LlamaTest::ROOT/examples/clients/ollama.mjs", $dir) == 0 or die;
symlink $modules, "$dir/node_modules" or die;

my $out = do {
    local $ENV{OLLAMA_HOST} = 'http://127.0.0.1:' . $t->{nginx_port};
    `node $dir/ollama.mjs 2>&1`;
};
my $res = eval { $LlamaTest::JSON->decode((split /\n/, $out)[-1]) };
ok($res, 'the ollama client ran') or diag $out;
$res //= { turns => [] };

my ($a1, $b1, $a2, $b2, $c1, $a3, $c2) = @{ $res->{turns} };
ok($a1 && $a1->{done} && $a1->{stream}, 'a streamed chat ends with done');
ok($b1 && $b1->{done} && !$b1->{stream}, 'a chat with stream false');
is($a1->{done_reason}, 'length', 'done_reason from finish_reason') if $a1;
is($a1->{eval_count}, 3, 'eval_count: num_predict 3 became max_tokens') if $a1;
ok($a1->{evaluated} > 300, "a's first turn evaluates its prompt: $a1->{evaluated}") if $a1;
ok($a2 && $a2->{evaluated} < 60,
   "a returns after b took the slot: only $a2->{evaluated} tokens evaluated") if $a2;
ok($b2 && $b2->{evaluated} < 60,
   "b returns: $b2->{evaluated} evaluated") if $b2;
ok($c2 && $c1->{evaluated} > 300 && $c2->{evaluated} < 60,
   "a conversation without a header, known by its start, returns after a "
   . "took the slot: $c2->{evaluated} evaluated") if $c2;
ok($res->{generate}{done}, 'generate, not streamed');
ok($res->{generate_stream}{parts} >= 2 && $res->{generate_stream}{done},
   "generate streamed: $res->{generate_stream}{parts} parts, the last done");
is($res->{generate_stream}{eval_count}, 3, 'its eval_count');
is($res->{ps}, 1, 'ps through the client');
is($res->{show}, 'gguf', 'show through the client');
is($res->{version}, '0.12.0', 'version');
is(scalar @{ $res->{tags} // [] }, 1, 'tags: the model llama-server serves');

ok($t->log_lines(qr/in "ollama-a-[0-9a-f]{24}" restored/),
   'the conversations were swapped and restored by their ids');

# what llama-server's replies said of the cache is read before the
# translation: the restores were effective, the cached tokens counted

my $m = $t->get('/metrics')->{content};
my ($eff) = $m =~ /^nginx_llama_session_restore_effects_total\{zone="llama",effect="effective"\} (\d+)$/m;
my ($cached) = $m =~ /^nginx_llama_session_prompt_tokens_total\{zone="llama",source="cache"\} (\d+)$/m;
ok(($eff // 0) >= 4, "the restores behind Ollama's requests were effective: $eff");
ok(($cached // 0) > 1000, "their cached tokens counted: $cached");

# plain HTTP: the stream's lines

my $r = $t->post('/api/chat', { model => 'm', messages => [
                     { role => 'user', content => 'Count to three.' } ],
                     options => { num_predict => 4 } },
                 headers => { 'X-Session-Id' => 'plain' });
is($r->{status}, 200, 'POST /api/chat');
is($r->{headers}{'content-type'}, 'application/x-ndjson', 'NDJSON');
my @lines = map { $LlamaTest::JSON->decode($_) } split /\n/, $r->{content};
ok(@lines >= 2, scalar(@lines) . ' lines');
ok(!grep({ $_->{done} } @lines[0 .. $#lines - 1]), 'done only on the last');
my $last = $lines[-1];
ok($last->{done}, 'the last line is done');
for my $k (qw(total_duration prompt_eval_count prompt_eval_duration
              eval_count eval_duration)) {
    ok(defined $last->{$k}, "the last line has $k");
}
is($last->{message}{role}, 'assistant', 'the message\'s role');
like($last->{created_at}, qr/^\d{4}-\d\d-\d\dT/, 'created_at');

# not streamed: one object

$r = $t->post('/api/generate', { model => 'm', prompt => 'Hi.', stream => \0,
                                 options => { num_predict => 2 } });
is($r->{status}, 200, 'POST /api/generate, stream false');
like($r->{headers}{'content-type'}, qr{^application/json}, 'JSON');
ok($r->{json}{done} && defined $r->{json}{response}, 'one object with response');
is(ref $r->{json}{context}, 'ARRAY', 'and a context');

# the rest

$r = $t->get('/api/ps');
is($r->{status}, 200, 'GET /api/ps');
is(scalar @{ $r->{json}{models} }, 1, 'one model');
$r = $t->post('/api/show', { model => 'm' });
is($r->{status}, 200, 'POST /api/show');
is($r->{json}{details}{format}, 'gguf', 'its details');
$r = $t->get('/');
is($r->{content}, 'Ollama is running', 'GET /');
is($t->request('HEAD', '/')->{status}, 200, 'HEAD /');

# Ollama's errors

$r = $t->post('/api/chat', '{"model": "m", "messages": [');
is($r->{status}, 400, 'a body that is not JSON: 400');
like($r->{json}{error}, qr/invalid JSON/, 'as {"error": "..."}');
$r = $t->post('/api/chat', { messages => [] });
is($r->{status}, 400, 'no model: 400');
is($r->{json}{error}, 'model is required', 'Ollama\'s words');
$r = $t->post('/api/chat', { model => 'm', messages => 'hi' });
is($r->{status}, 400, 'messages of the wrong type: 400');
$r = $t->post('/api/chat', { model => 'm', messages => [ { role => 'user',
                 content => 'x' } ], options => [ 1 ] });
is($r->{status}, 400, 'options of the wrong type: 400');
is($t->get('/api/pull')->{status}, 404, 'an Ollama path not served: 404');
is($t->post('/api/chat', { model => 'm', messages => [ { role => 'user', content => 'ok' } ], stream => \0, options => { num_predict => 2 } })->{status},
   200, 'the server still answers');

$t->stop;
done_testing;
