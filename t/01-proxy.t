#!/usr/bin/perl

# The foundation: nginx with the module enabled on a location carries chat
# completions and /completion requests to a real llama-server, streamed and
# not, and bodies (1 MB ones spooled to a temp file too) arrive intact.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use IO::Socket::INET;
use LlamaTest;
use Test::More;

my $JSON = $LlamaTest::JSON;

my $t = LlamaTest->new(workers => 2);
my $llama = $t->llama;

$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m slots=1 store=%%SLOTS%%;',
    upstream => 'keepalive 4;',
    server => q{
        client_max_body_size 16m;
        client_body_buffer_size 16k;
    },
    location => q{
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_buffering off;
        proxy_read_timeout 300s;
    }));

my %direct = (port => $llama);
my $prompt = { prompt => 'The quick brown fox jumps over', n_predict => 8,
               temperature => 0, seed => 1 };

# /completion, not streamed: the same greedy reply as llama-server alone
my $want = $t->post('/completion', $prompt, %direct);
is($want->{status}, 200, 'llama-server answers /completion');

my $r = $t->post('/completion', $prompt);
is($r->{status}, 200, '/completion through nginx');
is($r->{json}{content}, $want->{json}{content},
   '/completion reply equals the direct one');
is($r->{json}{tokens_evaluated}, $want->{json}{tokens_evaluated},
   'the whole prompt reached llama-server');
is($r->{json}{generation_settings}{n_predict}, 8,
   'fields of the body reached llama-server');

# chat completion, not streamed
my $chat = { messages => [ { role => 'system', content => 'You are terse.' },
                           { role => 'user', content => 'Say something.' } ],
             max_tokens => 6, temperature => 0, seed => 1 };

my $want_chat = $t->post('/v1/chat/completions', $chat, %direct);
$r = $t->post('/v1/chat/completions', $chat,
              headers => { 'X-Session-Id' => 'proxy-a' });
is($r->{status}, 200, 'chat completion through nginx');
is($r->{json}{choices}[0]{message}{content},
   $want_chat->{json}{choices}[0]{message}{content},
   'chat reply equals the direct one');
is($r->{json}{usage}{prompt_tokens}, $want_chat->{json}{usage}{prompt_tokens},
   'the whole chat prompt reached llama-server');

# streamed (SSE), chat and /completion
my ($status, $events, $raw) = $t->stream('/v1/chat/completions',
    { %$chat, stream => JSON::PP::true },
    headers => { 'X-Session-Id' => 'proxy-a' });
is($status, 200, 'streamed chat completion');
my $text = join '', map { ref $_ ? ($_->{choices}[0]{delta}{content} // '')
                                 : '' } @$events;
is($text, $want_chat->{json}{choices}[0]{message}{content},
   'streamed chat text equals the non-streamed reply');
like($raw, qr/data: \[DONE\]/, 'the stream ends with [DONE]');
cmp_ok(scalar @$events, '>', 2, 'the reply came as several events');

($status, $events) = $t->stream('/completion',
                                { %$prompt, stream => JSON::PP::true });
is($status, 200, 'streamed /completion');
$text = join '', map { ref $_ ? ($_->{content} // '') : '' } @$events;
is($text, $want->{json}{content},
   'streamed /completion text equals the non-streamed reply');
ok((grep { ref $_ && $_->{stop} } @$events), 'the stream has its last event');

# a 1 MB body: spooled to a temp file by nginx, intact at llama-server;
# its prompt computed whole as the first one was (on a slot that holds
# another prompt, a partial reuse can flip a near-tie of the random model's
# greedy choice on some CPUs)
my $big = { %$prompt, cache_prompt => JSON::PP::false,
            padding => 'x' x (1024 * 1024) };
$r = $t->post('/completion', $big);
is($r->{status}, 200, '1 MB body through nginx');
is($r->{json}{content}, $want->{json}{content},
   '1 MB body: the same reply as without the padding');
is($r->{json}{tokens_evaluated}, $want->{json}{tokens_evaluated},
   '1 MB body: the prompt arrived whole');

$t->stop;

# the same through the fake backend, which shows the exact bytes it got
my $t2 = LlamaTest->new(workers => 2);
$t2->fake;
$t2->nginx($t2->site(server => q{
    client_max_body_size 16m;
    client_body_buffer_size 16k;
}));

my $body = $JSON->encode($big);
$r = $t2->post('/completion', $body,
               headers => { 'content-type' => 'application/json',
                            'x-session-id' => 'big' });
is($r->{status}, 200, 'fake backend: 1 MB body');
my ($call) = grep { $_->{path} eq '/completion' } @{ $t2->fake_calls };
is($call->{body_len}, length $body, 'fake backend got every byte');
like($t2->read_file('error.log'), qr/a client request body is buffered to a temporary file/,
     'nginx spooled the 1 MB body to a temp file');

# chunked upload
my $s = IO::Socket::INET->new(PeerAddr => '127.0.0.1',
                              PeerPort => $t2->{nginx_port}) or die;
my $small = $JSON->encode($prompt);
print $s "POST /completion HTTP/1.1\r\nHost: x\r\n"
       . "Content-Type: application/json\r\n"
       . "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
       . sprintf("%x\r\n%s\r\n", 10, substr($small, 0, 10))
       . sprintf("%x\r\n%s\r\n0\r\n\r\n", length($small) - 10,
                 substr($small, 10));
my $reply = do { local $/; <$s> };
like($reply, qr{^HTTP/1.1 200}, 'chunked upload through nginx');
my @calls = grep { $_->{path} eq '/completion' } @{ $t2->fake_calls };
is($calls[-1]{body}, $small, 'chunked upload arrives whole');

$t2->stop;
done_testing;
