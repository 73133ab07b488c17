#!/usr/bin/perl

# Session identity: each source, their order, system-prompt sharing,
# "default" never saved, safe keys for hostile ids, the model and the
# namespace in the key, what passes by, and what slot calls carry.
# Against the fake backend, which logs every call it gets.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use Digest::SHA qw(sha256_hex);
use LlamaTest;
use Test::More;

my $JSON = $LlamaTest::JSON;

my $t = LlamaTest->new(workers => 2);
$t->fake;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    upstream => '',
    server => q{
        underscores_in_headers on;
        add_header X-S-Id $llama_session_id always;
        add_header X-S-Key $llama_session_key always;
        add_header X-S-Action $llama_session_action always;
        add_header X-S-Slot $llama_session_slot always;
    },
    extra => q{
        location /custom/ {
            llama_session llama;
            llama_session_id_headers X-Chat;
            llama_session_id_fields meta.conv turn;
            llama_session_id_fallback off;
            proxy_pass http://llama/;
        }

        location /spool/ {
            llama_session llama;
            client_max_body_size 16m;
            client_body_buffer_size 16k;
            proxy_pass http://llama/;
        }

        location /tenant/ {
            llama_session llama;
            llama_session_namespace $http_x_tenant;
            proxy_pass http://llama/;
        }
    }));

sub ask {
    my ($body, %h) = @_;
    my $path = delete $h{path} // '/v1/chat/completions';
    my $r = $t->post($path, $body, headers => \%h);
    return { status => $r->{status}, id => $r->{headers}{'x-s-id'},
             key => $r->{headers}{'x-s-key'},
             action => $r->{headers}{'x-s-action'}, r => $r };
}

my $chat = { messages => [ { role => 'user', content => 'hi' } ] };

# headers, in order
my $r = ask($chat, 'X-Session-Id' => 'h1');
is($r->{status}, 200, 'a request with X-Session-Id');
is($r->{id}, 'h1', 'X-Session-Id names the session');
like($r->{key}, qr/^h1-[0-9a-f]{24}$/, 'its key is the id and a hash');
is(ask($chat, 'X-Conversation-Id' => 'c1')->{id}, 'c1', 'X-Conversation-Id');
is(ask($chat, 'Session-Id' => 's1')->{id}, 's1', 'Session-Id');
is(ask($chat, 'Conversation-Id' => 'cv1')->{id}, 'cv1', 'Conversation-Id');
is(ask($chat, 'X-OpenWebUI-Chat-Id' => 'ow1')->{id}, 'ow1',
   'X-OpenWebUI-Chat-Id');
is(ask($chat, 'X-Session-Affinity' => 'af1')->{id}, 'af1',
   'X-Session-Affinity (opencode, pi)');
is(ask($chat, 'X-Dynamo-Session-Id' => 'dy1')->{id}, 'dy1',
   'X-Dynamo-Session-Id');
is(ask($chat, 'session_id' => 'pi1', 'x-client-request-id' => 'rq')->{id},
   'pi1', 'session_id with underscores_in_headers on (pi)');
is(ask($chat, 'x-client-request-id' => 'rq')->{id}, 'default',
   'x-client-request-id is not a session');
is(ask($chat, 'Conversation-Id' => 'late', 'X-Session-Id' => 'first',
       'Session-Id' => 'mid')->{id}, 'first', 'X-Session-Id goes first');
is(ask($chat, 'Session-Id' => 'mid', 'X-Conversation-Id' => 'xc')->{id},
   'xc', 'X-Conversation-Id before Session-Id');
is(ask($chat, 'X-Session-Id' => '   ', 'Session-Id' => 'next')->{id},
   'next', 'an empty header does not count');

# body fields, after the headers
is(ask({ %$chat, session_id => 'b1' })->{id}, 'b1', 'body session_id');
is(ask({ %$chat, conversation_id => 'b2' })->{id}, 'b2',
   'body conversation_id');
is(ask({ %$chat, chat_id => 'b3' })->{id}, 'b3', 'body chat_id');
is(ask({ %$chat, chat_id => 42 })->{id}, '42', 'an integer id counts');
is(ask({ %$chat, prompt_cache_key => 'pk' })->{id}, 'pk',
   'body prompt_cache_key');
is(ask({ %$chat, metadata => { session_id => 'md' } })->{id}, 'md',
   'body metadata.session_id');
is(ask({ %$chat, chat_id => 'b3', session_id => 'b1',
         conversation_id => 'b2' })->{id}, 'b1',
   'session_id before conversation_id and chat_id');
is(ask({ %$chat, session_id => 'body' }, 'X-Session-Id' => 'head')->{id},
   'head', 'headers before body fields');
is(ask({ %$chat, session_id => '' , chat_id => 'c' })->{id}, 'c',
   'an empty field does not count');

# the system prompt
my $sys = 'You are a helpful assistant with a long prompt.';
my $want = 'sys-' . substr(sha256_hex($sys), 0, 16);
my $openai = { messages => [ { role => 'system', content => $sys },
                             { role => 'user', content => 'one' } ] };
is(ask($openai)->{id}, $want, 'OpenAI system message: sys- and SHA-256');
is(ask({ messages => [ { role => 'system', content => $sys },
                       { role => 'user', content => 'another' } ] })->{id},
   $want, 'the same system prompt shares the session');
is(ask({ system => $sys, messages => [ { role => 'user', content => 'x' } ] },
       path => '/v1/messages')->{id},
   $want, 'Anthropic top-level system string');
is(ask({ system => [ { type => 'text', text => 'part one' },
                     { type => 'text', text => 'part two' } ],
         messages => [] }, path => '/v1/messages')->{id},
   'sys-' . substr(sha256_hex("part one\npart two"), 0, 16),
   'Anthropic system text blocks');
is(ask({ model => 'm', system => $sys, prompt => 'x' },
       path => '/api/generate')->{id},
   $want, 'Ollama /api/generate system');
is(ask({ messages => [ { role => 'system',
                         content => [ { type => 'text', text => $sys } ] },
                       { role => 'user', content => 'parts' } ] })->{id},
   $want, 'system content as text parts');
isnt(ask({ messages => [ { role => 'system', content => "$sys!" } ] })->{id},
     $want, 'another system prompt, another session');
is(ask({ %$openai, session_id => 'named' })->{id}, 'named',
   'an id field goes before the system prompt');

# default
$r = ask($chat);
is($r->{id}, 'default', 'no id and no system prompt: default');
is($r->{key}, 'default', 'default has the key "default"');
is(ask('not json', 'Content-Type' => 'application/json')->{id}, 'default',
   'a body that is not JSON: default');
$r = ask('{"session_id": "broken"', 'X-Session-Id' => 'hdr');
is($r->{status}, 200, 'invalid JSON with a header is proxied');
is($r->{id}, 'hdr', 'invalid JSON: the session comes from the header');
my ($last) = grep { $_->{path} eq '/v1/chat/completions' }
             reverse @{ $t->fake_calls };
is($last->{body}, '{"session_id": "broken"', 'invalid JSON arrives unchanged');

# bodies built to trip a scanner: answered, default, at once
for my $evil ('{"messages":[{]}}', '{"messages":[1 }]}',
              '{"messages":[{"role":"system","content":[}]}]}',
              '{"system":' . ('[' x 600) . (']' x 600) . '}',
              '{"messages":["a\\"]}', '{"a":}') {
    $r = ask($evil, 'Content-Type' => 'application/json');
    is($r->{status}, 200, 'a malformed body is proxied: ' . substr($evil, 0, 30));
    is($r->{id}, 'default', 'and runs as default');
}

# default is never saved: a named session, then default, then another one
$t->fake_script({});
ask($chat, 'X-Session-Id' => 'keep-me');
ask($chat, 'X-Session-Id' => 'keep-me');
ask($chat);
ask($chat, 'X-Session-Id' => 'other');
ask($chat, 'X-Session-Id' => 'keep-me');
my @saves = map { $JSON->decode($_->{body})->{filename} }
            grep { $_->{path} =~ m{^/slots/} && $_->{query} eq 'action=save' }
            @{ $t->fake_calls };
ok(!(grep { /^default/ } @saves), 'default was never saved');
ok((grep { /^keep-me-/ } @saves), 'the named session was saved');
my @files = map { s{.*/}{}r } glob($t->dir . '/slots/*');
ok(!(grep { /^default/ } @files), 'no file for default in the save folder');
ok((grep { /^keep-me-[0-9a-f]{24}\.[0-9a-f]{8}\.bin$/ } @files),
   'the named session has its file') or diag "@files";

# hostile ids map to safe, deterministic, distinct keys
my @hostile = ('../../etc/passwd', 'a/b', 'a_b', 'with space', "nul\0byte",
               "\x{e9}lan \x{65e5}\x{672c}", 'x' x 256, '..', '.hidden.',
               "line\nbreak");
my %keys;
for my $id (@hostile) {
    my $k1 = ask({ %$chat, session_id => $id })->{key};
    my $k2 = ask({ %$chat, session_id => $id })->{key};
    my $name = length $id > 40 ? '256-byte id' : $JSON->encode($id);
    like($k1, qr/^[A-Za-z0-9_-]{1,32}-[0-9a-f]{24}$/, "safe key for $name");
    is($k1, $k2, "the same key again for $name");
    $keys{$k1}++;
}
is(scalar keys %keys, scalar @hostile, 'every hostile id has its own key');
is(ask({ %$chat, session_id => "line\nbreak" })->{id}, 'line\x0abreak',
   '$llama_session_id shows control characters as \xHH');
ask({ %$chat, session_id => 'after' });
@files = map { s{.*/}{}r } glob($t->dir . '/slots/*');
is_deeply([ grep { !/^[A-Za-z0-9_-]{1,32}-[0-9a-f]{24}\.[0-9a-f]{8}\.(bin|json)$/ } @files ], [],
          'every file in the save folder has a safe name');
ok(!-e '/etc/passwd.bin' && !-e $t->dir . '/passwd.bin',
   'nothing was written outside the save folder');

# bodies from 1 KB to 8 MB, in memory or spooled to a temp file: the id
# comes from the body either way, and the body arrives unchanged
for my $size (1024, 16 * 1024, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024) {
    my $body = $JSON->encode({ session_id => "size-$size", %$chat,
                               pad => 'z' x $size });
    my $r = ask($body, path => '/spool/v1/chat/completions',
                'Content-Type' => 'application/json');
    is($r->{id}, "size-$size", "a body of $size bytes: the id from the body");
    my ($call) = grep { $_->{path} eq '/v1/chat/completions' }
                 reverse @{ $t->fake_calls };
    is($call->{body_len}, length $body, "a body of $size bytes arrives whole");
}
ok($t->log_lines(qr/a client request body is buffered to a temporary file/),
   'the large bodies went through temp files');

# the model and the namespace are in the key
my $k1 = ask({ %$chat, model => 'model-one' }, 'X-Session-Id' => 'same')->{key};
my $k2 = ask({ %$chat, model => 'model-two' }, 'X-Session-Id' => 'same')->{key};
isnt($k1, $k2, 'another model, another key');
my $ka = ask($chat, path => '/tenant/v1/chat/completions',
             'X-Session-Id' => 'same', 'X-Tenant' => 'a')->{key};
my $kb = ask($chat, path => '/tenant/v1/chat/completions',
             'X-Session-Id' => 'same', 'X-Tenant' => 'b')->{key};
isnt($ka, $kb, 'another tenant, another key');

# configured lists
is(ask($chat, path => '/custom/v1/chat/completions', 'X-Chat' => 'cx',
       'X-Session-Id' => 'ignored')->{id}, 'cx', 'a configured header');
is(ask({ %$chat, meta => { conv => 'mc' }, session_id => 'ignored' },
       path => '/custom/v1/chat/completions')->{id}, 'mc',
   'a configured nested field');
is(ask({ %$chat, turn => 7 }, path => '/custom/v1/chat/completions')->{id},
   '7', 'the second configured field');
is(ask($openai, path => '/custom/v1/chat/completions')->{id}, 'default',
   'llama_session_id_fallback off: no system hash');

# what uses no slot passes by, without a slot call
my $before = scalar @{ $t->fake_calls };
for my $req ([ 'GET', '/v1/models' ], [ 'GET', '/health' ],
             [ 'OPTIONS', '/v1/chat/completions' ],
             [ 'POST', '/tokenize' ], [ 'POST', '/detokenize' ],
             [ 'POST', '/apply-template' ],
             [ 'POST', '/v1/messages/count_tokens' ])
{
    my $r = $t->request($req->[0], $req->[1],
                        body => $req->[0] eq 'POST' ? $chat : undef,
                        headers => { 'X-Session-Id' => 'bypassed' });
    is($r->{headers}{'x-s-action'}, 'bypass', "$req->[0] $req->[1] passes by");
}
my @after = @{ $t->fake_calls }[ $before .. $#{ $t->fake_calls } ];
is(scalar(grep { $_->{path} =~ m{^/slots} } @after), 0,
   'they made no slot call');
is(scalar @after, 7, 'and all reached the backend');

# clients cannot drive llama-server's slot API through the module
$before = scalar @{ $t->fake_calls };
for my $path ('/slots/0?action=restore', '/slots/0?action=erase',
              '/v1/../slots/0?action=save', '/SLOTS/1?action=save') {
    my $r = $t->request('POST', $path,
                        body => { filename => 'keep-me-x.bin' });
    is($r->{status}, 403, "POST $path is refused");
}
is(scalar @{ $t->fake_calls }, $before, 'none reached the backend');

# embeddings use the slot as default, whatever they name
$r = ask({ input => 'text' }, path => '/v1/embeddings',
         'X-Session-Id' => 'emb');
is($r->{id}, 'default', 'embeddings run as default');
isnt($r->{action}, 'bypass', 'embeddings use the slot');

# slot calls carry their own method, body and headers
$t->fake_script({});
ask({ %$chat, pad => 'p' x 5000 }, 'X-Session-Id' => 'leak-a',
    'Authorization' => 'Bearer client-secret');
ask({ %$chat, pad => 'p' x 5000 }, 'X-Session-Id' => 'leak-b',
    'Authorization' => 'Bearer client-secret');
ask({ %$chat, pad => 'p' x 5000 }, 'X-Session-Id' => 'leak-a',
    'Authorization' => 'Bearer client-secret');
# the isolation review: the body as llama-server reads it (the last of
# duplicate members, keys decoded), and a probe only when llama-server
# generates at most one token: the first of n_predict,
# max_completion_tokens and max_tokens that is not null

sub raw {
    my ($text, %h) = @_;
    my $rr = $t->request('POST', delete $h{path} // '/v1/chat/completions',
                         body => $text,
                         headers => { 'Content-Type' => 'application/json',
                                      %h });
    return { status => $rr->{status}, id => $rr->{headers}{'x-s-id'},
             r => $rr };
}

is(raw('{"messages":[],"session_id":"first","session_id":"last"}')->{id},
   'last', 'a duplicate session_id: the last, as llama-server');
is(raw('{"messages":[],"session_\\u0069d":"escaped"}')->{id}, 'escaped',
   'an escaped key is decoded');
is(raw('{"messages":[],"metadata":{"session_id":"m1","session_id":"m2"}}')->{id},
   'm2', 'a duplicate in a nested object: the last');
is(raw("\xef\xbb\xbf" . '{"messages":[],"session_id":"bom"}')->{id}, 'bom',
   'a UTF-8 BOM before the body');
is(ask({ %$chat, session_id => 'p1', max_tokens => 1, n_predict => 50 })->{id},
   'p1', 'max_tokens 1 with n_predict 50 generates 50 tokens: no probe');
is(ask({ %$chat, session_id => 'p2', max_tokens => 1, n_predict => undef })->{id},
   'default', 'n_predict null, max_tokens 1: a probe');
is(raw('{"messages":[],"session_id":"p3","max_tokens":1,"max_tokens":100}')->{id},
   'p3', 'a duplicate max_tokens: the last, 100, no probe');
is(raw('{"messages":[],"session_id":"p4","n_predict":4294967297}')->{id},
   'default', 'n_predict 2^32+1 is 1 in llama-server\'s int: a probe');
is(raw('{"messages":[],"session_id":"p5","max_tokens":1.5}')->{id},
   'default', 'max_tokens 1.5 is 1 there: a probe');
is(raw('{"messages":[],"session_id":"p6","max_tokens":"1"}')->{id}, 'p6',
   'max_tokens "1" (llama-server refuses a string): no probe');
is(raw('{"messages":[],"session_id":"p7","n_predict":100,"max_tokens":1}',
       path => '/v1/messages')->{id}, 'default',
   '/v1/messages passes on max_tokens alone: a probe');

my @slot_calls = grep { $_->{path} =~ m{^/slots} } @{ $t->fake_calls };
ok(scalar @slot_calls >= 3, 'slot calls were made');
my @leaks = grep { $_->{headers}{authorization}
                   || $_->{headers}{'x-session-id'}
                   || ($_->{body} // '') =~ /pad|messages/ } @slot_calls;
is(scalar @leaks, 0, 'no client header or body leaks into slot calls');
my @posts = grep { $_->{method} eq 'POST' } @slot_calls;
ok(@posts, 'slot actions are POSTs');
is(scalar(grep { ($_->{headers}{'content-length'} // -1)
                 != length($_->{body}) } @posts), 0,
   'each slot action has its own Content-Length');
is(scalar(grep { $_->{query} =~ /action=(save|restore)/
                 && $_->{body} !~ /^\{"filename":"[A-Za-z0-9_-]+\.[0-9a-f]{8}\.bin(\.tmp)?"\}$/ }
          @posts), 0, 'save and restore carry only {"filename": ...}');
is(scalar(grep { $_->{method} eq 'GET' && $_->{path} eq '/slots'
                 && $_->{body_len} } @slot_calls), 0,
   'GET /slots has no body');

$t->stop;
done_testing;
