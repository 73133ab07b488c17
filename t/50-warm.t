#!/usr/bin/perl

# Warm starts, against a real llama-server: a new conversation starts from
# the system prompt it shares with earlier ones (from the slot, or from
# the saved base), never from another conversation's messages, never
# across namespaces; and requests under a conversation's id with a prompt
# of their own (a frontend's title and follow-up requests, Claude Code's
# subagents and side queries, probes) never take the conversation's state.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
$t->llama;

my $conf = $t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% save_idle=1s;',
    upstream => '',
    http => 'map $http_x_tenant $tenant { default $http_x_tenant; }',
    server => 'llama_session_namespace $tenant;',
    location => q{
        proxy_read_timeout 300s;
        add_header X-S-Action $llama_session_action always;
        add_header X-S-Key $llama_session_key always;
        add_header X-S-Id $llama_session_id always;
    },
    extra => q{
        location /cold/ {
            llama_session llama;
            llama_session_warm off;
            proxy_pass http://llama/;
            proxy_read_timeout 300s;
            add_header X-S-Action $llama_session_action always;
        }

        location /api/ {
            llama_session_api llama;
        }
    });

$t->nginx($conf);

my $system = join ' ', map { "Rule $_: answer briefly and politely." } 1 .. 150;
my $other = join ' ', map { "Clause $_ of the other assistant." } 1 .. 150;

sub chat {
    my ($sid, $messages, %o) = @_;
    my $r = $t->post(($o{path} // '') . '/v1/chat/completions',
                     { messages => $messages, max_tokens => $o{max} // 4,
                       temperature => 0, seed => 7 },
                     headers => { 'X-Session-Id' => $sid,
                                  %{ $o{headers} // {} } });
    die "$sid: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    return { prompt => $r->{json}{usage}{prompt_tokens},
             cached => $r->{json}{usage}{prompt_tokens_details}{cached_tokens},
             action => $r->{headers}{'x-s-action'},
             key => $r->{headers}{'x-s-key'},
             id => $r->{headers}{'x-s-id'},
             text => $r->{json}{choices}[0]{message}{content} };
}

sub sys_msgs { [ { role => 'system', content => $_[0] // $system } ] }

# A, then B, C, D: new conversations with the same system prompt
my $a_first = join ' ', map { "My secret note $_ is about apples." } 1 .. 20;
my @a = (@{ sys_msgs() }, { role => 'user', content => $a_first });
my $ra = chat('A', \@a);
is($ra->{action}, 'fresh', 'A, the first conversation, starts fresh');
my @bases = glob($t->dir . '/slots/base-*.bin');
is(scalar @bases, 1, 'and its system prompt is saved as a base');
my $sys_tokens = $ra->{cached};
cmp_ok($sys_tokens, '>', 1000,
       "A's own request found the system prompt computed ($sys_tokens tokens)");

my %first;
for my $sid (qw(B C D)) {
    # B's first message starts as A's did: it must learn nothing of it
    my $text = $sid eq 'B' ? "My secret note 1 is about apples. Is it?"
                           : "Hello, I am $sid.";
    my $r = chat($sid, [ @{ sys_msgs() }, { role => 'user', content => $text } ]);
    $first{$sid} = $r;
    is($r->{action}, 'warm', "$sid starts warm");
    cmp_ok($r->{cached}, '>=', $sys_tokens - 2,
           "$sid finds the whole system prompt cached ($r->{cached} of "
           . "$r->{prompt})");
}
is($first{B}{cached}, $first{C}{cached},
   'B, whose message starts as A\'s, gets no more cached tokens than C: '
   . 'nothing of A\'s messages is shared');
ok($t->log_lines(qr/in "B-\w+" warm from the slot's system prompt \(base "base-[0-9a-f]{24}"\), 0 bytes read/),
   'the swap line tells where the warm start came from');

# A comes back and finds its whole history
push @a, { role => 'assistant', content => $ra->{text} // 'ok' },
         { role => 'user', content => 'And the next one?' };
my $ra2 = chat('A', \@a);
is($ra2->{action}, 'restore', 'A comes back: restored from its own file');
cmp_ok($ra2->{cached}, '>=', $ra->{prompt} - 2,
       "A finds its whole history ($ra2->{cached} cached, its first turn "
       . "had $ra->{prompt})");

# another system prompt in between, then a new conversation of the first
my $re = chat('E', [ @{ sys_msgs($other) },
                     { role => 'user', content => 'Other question.' } ]);
is($re->{action}, 'fresh', 'E, another system prompt, starts fresh');
my $rf = chat('F', [ @{ sys_msgs() }, { role => 'user', content => 'F here.' } ]);
is($rf->{action}, 'warm', 'F, the first system prompt again, starts warm');
cmp_ok($rf->{cached}, '>=', $sys_tokens - 2,
       "from the saved base ($rf->{cached} cached)");
ok($t->log_lines(qr/in "F-\w+" warm from base "base-[0-9a-f]{24}", \d+ tokens, \d+ bytes read in [\d.]+ ms/),
   'the swap line says which base was read and how many bytes');

# the same reply from a warm start and from an erased slot
my @g = (@{ sys_msgs() }, { role => 'user', content => 'Say something.' });
my $warm = chat('G', \@g, max => 12);
is($warm->{action}, 'warm', 'G starts warm');
my $cold = chat('H', \@g, max => 12, path => '/cold');
is($cold->{action}, 'fresh', 'H, the same request with warm starts off, '
   . 'starts fresh');
is($cold->{cached}, 0, 'from an empty slot');
is($warm->{text}, $cold->{text},
   'the same reply text from the warm start and from the erased slot');

# namespaces: the same system prompt does not cross tenants
my $rt = chat('T1', [ @{ sys_msgs() }, { role => 'user', content => 'Hi.' } ],
              headers => { 'X-Tenant' => 'other' });
is($rt->{action}, 'fresh', 'a new conversation of another tenant starts '
   . 'fresh, though the slot and a base hold the same system prompt');
is(scalar(my @b = glob($t->dir . '/slots/base-*.bin')), 3,
   'the tenant got a base of its own');
my $rt2 = chat('T2', [ @{ sys_msgs() }, { role => 'user', content => 'Yo.' } ],
               headers => { 'X-Tenant' => 'other' });
is($rt2->{action}, 'warm', 'its next conversation starts warm');
my $ru = chat('U', [ @{ sys_msgs() }, { role => 'user', content => 'Me.' } ]);
is($ru->{action}, 'warm', 'and so does the first tenant\'s, from its own '
   . 'base');
ok($t->log_lines(qr/in "U-\w+" warm from base/),
   'restored from the base, not from the other tenant\'s slot');

my $api = $t->get('/api/sessions/current')->{json};
cmp_ok($api->{stats}{warm}, '>=', 7, "the API counts warm starts "
       . "($api->{stats}{warm})");
is($api->{stats}{bases}, 3, 'and bases saved');

# a chat of its own, then a frontend's side requests under the chat's id
my @chat = (@{ sys_msgs() },
            { role => 'user', content => join ' ', map { "Long chat line $_." }
                                                      1 .. 150 });
my $c1 = chat('chat-9', \@chat, headers => { 'X-OpenWebUI-Chat-Id' => 'x' });
push @chat, { role => 'assistant', content => $c1->{text} // 'ok' },
            { role => 'user', content => 'Tell me more about it.' };
my $c2 = chat('chat-9', \@chat);
is($c2->{action}, 'hit', 'the chat\'s second turn is a hit');

my $history = "USER: Long chat line 1.\nASSISTANT: ok";
my $title = chat('chat-9', [ { role => 'user', content =>
    "### Task:\nGenerate a concise, 3-5 word title with an emoji "
    . "summarizing the chat history.\n### Chat History:\n<chat_history>\n"
    . "$history\n</chat_history>" } ], max => 8);
isnt($title->{key}, $c2->{key}, 'a title request under the chat\'s id is '
     . 'another session');
my $follow = chat('chat-9', [ { role => 'user', content =>
    "### Task:\nSuggest 3-5 relevant follow-up questions or prompts that the "
    . "user might naturally ask next.\n<chat_history>\n$history\n"
    . "</chat_history>" } ], max => 8);
isnt($follow->{key}, $c2->{key}, 'so is a follow-up request');
# an idle save in between (save_idle=1s)
my $idle = () = $t->log_lines(qr/idle save of /);
$t->wait_for(sub { $t->log_lines(qr/idle save of /) > $idle }, 15)
    or diag 'no idle save in between';
push @chat, { role => 'assistant', content => 'More.' },
            { role => 'user', content => 'Thanks, one more.' };
my $c3 = chat('chat-9', \@chat);
is($c3->{key}, $c2->{key}, 'the chat\'s next turn is the chat\'s session');
cmp_ok($c3->{cached}, '>=', $c2->{prompt} - 2,
       "and finds its whole history ($c3->{cached} cached, the previous turn "
       . "had $c2->{prompt})");

# a chat with no system prompt: its side requests still keep off it
my @plain = ({ role => 'user', content => join ' ', map { "Plain line $_." }
                                                       1 .. 150 });
my $p1 = chat('plain', \@plain);
push @plain, { role => 'assistant', content => 'ok' },
             { role => 'user', content => 'Go on.' };
my $p2 = chat('plain', \@plain);
my $pt = chat('plain', [ { role => 'user', content =>
    "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the "
    . "chat history.\n<chat_history>\nUSER: Plain line 1.\n</chat_history>" } ]);
isnt($pt->{key}, $p2->{key}, 'a tags request of a chat without a system '
     . 'prompt is another session too');
push @plain, { role => 'assistant', content => 'ok' },
             { role => 'user', content => 'And then?' };
my $p3 = chat('plain', \@plain);
cmp_ok($p3->{cached}, '>=', $p2->{prompt} - 2,
       "the chat finds its whole history ($p3->{cached} of $p2->{prompt})");

# a probe (max_tokens 1) under the chat's id runs as "default"
my $probe = chat('chat-9', [ { role => 'user', content => 'Hi' } ], max => 1);
is($probe->{id}, 'default', 'a probe with max_tokens 1 runs as "default"');
push @chat, { role => 'assistant', content => 'Sure.' },
            { role => 'user', content => 'Last one.' };
my $c4 = chat('chat-9', \@chat);
cmp_ok($c4->{cached}, '>=', $c3->{prompt} - 2,
       "the chat finds its whole history after the probe ($c4->{cached})");

# Claude Code as it talks: /v1/messages, its session header, billing block
sub claude {
    my ($session, $system_blocks, $messages, %o) = @_;
    my $r = $t->post('/v1/messages',
                     { model => 'claude-sonnet', max_tokens => $o{max} // 4,
                       system => $system_blocks, messages => $messages,
                       temperature => 0,
                       metadata => { user_id => $LlamaTest::JSON->encode(
                           { device_id => 'd' x 64, account_uuid => '',
                             session_id => $session }) },
                       $o{tools} ? (tools => $o{tools}) : () },
                     headers => { 'X-Claude-Code-Session-Id' => $session,
                                  'anthropic-version' => '2023-06-01',
                                  'x-app' => 'cli',
                                  %{ $o{headers} // {} } });
    die "claude: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    my $u = $r->{json}{usage};
    return { cached => $u->{cache_read_input_tokens} // 0,
             prompt => ($u->{input_tokens} // 0)
                       + ($u->{cache_read_input_tokens} // 0),
             key => $r->{headers}{'x-s-key'},
             id => $r->{headers}{'x-s-id'},
             action => $r->{headers}{'x-s-action'} };
}

my $cc_main = join ' ', map { "Claude Code instruction $_." } 1 .. 120;
my @cc_system = (
    { type => 'text', text => 'x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=cli; cch=12345;' },
    { type => 'text', text => 'You are Claude Code, Anthropic\'s official CLI for Claude.' },
    { type => 'text', text => $cc_main, cache_control => { type => 'ephemeral' } });
my $tools = [ { name => 'Bash', description => 'Run a command',
                input_schema => { type => 'object',
                                  properties => { command => { type => 'string' } } } } ];
my @cc = ({ role => 'user', content => [ { type => 'text', text =>
    "<system-reminder>\nAs you answer, use CLAUDE.md.\n</system-reminder>\n"
    . join(' ', map { "Fix bug $_ in the parser." } 1 .. 60) } ] });
my $m1 = claude('cc-1', \@cc_system, \@cc, tools => $tools);
is($m1->{id}, 'cc-1', 'X-Claude-Code-Session-Id names the session');

# a per-request cch= is in no key
$cc_system[0]{text} =~ s/cch=12345/cch=67890/;
push @cc, { role => 'assistant', content => 'Looking.' },
          { role => 'user', content => 'Go on.' };
my $m2 = claude('cc-1', \@cc_system, \@cc, tools => $tools);
is($m2->{key}, $m1->{key}, 'another cch= is the same session');
cmp_ok($m2->{cached}, '>=', $m1->{prompt} - 2,
       "the main thread's second turn finds its history ($m2->{cached} of "
       . "$m1->{prompt})");

# a subagent and a side query under the same session
my $sub = claude('cc-1', [ { type => 'text', text => 'x-anthropic-billing-header: cc_version=2.1.197.f0e; cc_entrypoint=cli; cc_is_subagent=true;' },
                           { type => 'text', text => 'You are an agent for Claude Code: explore the code.' } ],
                 [ { role => 'user', content => 'Find the parser.' } ],
                 headers => { 'x-claude-code-agent-id' => 'aexplore-0123456789abcdef' });
isnt($sub->{key}, $m1->{key}, 'a subagent is a session of its own');
my $side = claude('cc-1', [ { type => 'text', text => 'x-anthropic-billing-header: cc_version=2.1.197.777; cc_entrypoint=cli;' },
                            { type => 'text', text => 'Generate a concise, sentence-case title (3-7 words).' } ],
                  [ { role => 'user', content => '<session>Fix bugs</session>' } ],
                  max => 8);
isnt($side->{key}, $m1->{key}, 'so is a side query');
push @cc, { role => 'assistant', content => 'Done.' },
          { role => 'user', content => 'Next.' };
my $m3 = claude('cc-1', \@cc_system, \@cc, tools => $tools);
is($m3->{key}, $m1->{key}, 'the main thread\'s next turn');
cmp_ok($m3->{cached}, '>=', $m2->{prompt} - 2,
       "finds its whole history after the subagent and the side query "
       . "($m3->{cached} of $m2->{prompt})");
my $other_cc = claude('cc-2', \@cc_system, [ $cc[0] ], tools => $tools);
isnt($other_cc->{key}, $m1->{key},
     'another Claude Code session in the same project has its own key');
is($other_cc->{action}, 'warm', 'and starts warm from the shared system '
   . 'prompt and tools');

# Codex's environment item (a user message that is wholly one
# <environment_context> block: folder, shell, date) is the client's, the
# same in each conversation it starts: part of the base.  A user message
# that only mentions such a block is the user's, never part of it.
my $env = "<environment_context>\n  <cwd>/srv/project</cwd>\n  "
        . "<shell>bash</shell>\n  <current_date>2026-12-01</current_date>\n"
        . join('', map { "  <note>entry $_ of the workspace</note>\n" } 1 .. 40)
        . "</environment_context>";
my @env = (@{ sys_msgs() }, { role => 'user', content => $env });
my $e1 = chat('env-1', [ @env, { role => 'user', content => 'Say hi.' } ]);
my $e2 = chat('env-2', [ @env, { role => 'user', content => 'Count to 3.' } ]);
is($e2->{action}, 'warm', 'a second conversation with Codex\'s environment '
   . 'item starts warm');
cmp_ok($e2->{cached}, '>=', $sys_tokens + 200,
       "from the system prompt and the environment item ($e2->{cached} "
       . "cached, the system prompt alone $sys_tokens)");
my $e3 = chat('env-3', [ @{ sys_msgs() },
                         { role => 'user', content => "Look: $env" },
                         { role => 'user', content => 'Count to 3.' } ]);
cmp_ok($e3->{cached}, '<', $sys_tokens + 10,
       "a user message that quotes one is the user's: $e3->{cached} cached");
my $e4 = chat('env-4', [ @{ sys_msgs() },
                         { role => 'user',
                           content => [ { type => 'text', text => $env },
                                        { type => 'text', text => 'Hi.' } ] },
                         { role => 'user', content => 'Count to 3.' } ]);
cmp_ok($e4->{cached}, '<', $sys_tokens + 10,
       "so is one with a part after it: $e4->{cached} cached");

# both servers restart: a new conversation starts warm from the saved base
$t->stop_nginx;
$t->stop_llama;
$t->llama;
$t->nginx($conf);
my $rz = chat('Z', [ @{ sys_msgs() }, { role => 'user', content => 'Back.' } ]);
is($rz->{action}, 'warm', 'after both restarted, a new conversation starts '
   . 'warm');
cmp_ok($rz->{cached}, '>=', $sys_tokens - 2,
       "from the saved base ($rz->{cached} cached)");

$t->stop;
done_testing();
