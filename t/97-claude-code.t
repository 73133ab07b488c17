#!/usr/bin/perl

# Claude Code through the module, on four slots.  A recorded exchange of
# the real CLI (t/data/claude-code-exchange.jsonl: Claude Code 2.1.197,
# two conversations and the second turn of the first, recorded by
# t/record-anthropic.mjs) replayed with its own headers and bodies against
# a real llama-server: the second conversation starts warm from the
# first one's system prompt and tools (its billing header made the same,
# llama_session_canonical), four more take the slots, and the first one's
# next turn comes back by restore.  Then the CLI itself (rig/npm-agents.sh)
# runs headless against the module and the fake backend: two
# conversations and a --resume, each answered.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $JSON = $LlamaTest::JSON;

my @recorded;
{
    open my $fh, '<', "$FindBin::Bin/data/claude-code-exchange.jsonl" or die;
    @recorded = grep { $_->{method} eq 'POST' }
                map { $JSON->decode($_) } grep { /\S/ } <$fh>;
}
is(scalar @recorded, 3, 'the recording: three requests of Claude Code');

# a recorded request as Claude Code sent it (max_tokens made small: the
# rig's model is random); its session id and first prompt may be changed
sub replay {
    my ($t, $req, %o) = @_;
    my %h = %{ $req->{headers} };
    delete @h{qw(host content-length connection accept-encoding)};
    my $body = $JSON->decode($JSON->encode($req->{body}));
    $body->{max_tokens} = 4;
    $body->{temperature} = 0;
    if ($o{sid}) {
        $h{'x-claude-code-session-id'} = $o{sid};
        my $u = $body->{messages}[0]{content};
        $u->[-1]{text} = "say $o{sid}";
    }
    my ($status, $events, $raw) = $t->stream($req->{path}, $body,
                                             headers => \%h);
    my %ev = map { ($_->{type} // '') => $_ } grep { ref } @$events;
    my $usage = $ev{message_delta}{usage} // {};
    return { status => $status, raw => $raw,
             types => [ map { $_->{type} } grep { ref } @$events ],
             input => $usage->{input_tokens} // 0,
             cached => $usage->{cache_read_input_tokens} // 0 };
}

my $t = LlamaTest->new(workers => 2);
$t->llama(np => 4, ctx => 4 * 40960, args => [ '-b', 4096, '-ub', 1024 ]);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m slots=4 store=%%SLOTS%%;',
    server => 'llama_session_warm system;',
    location => 'proxy_read_timeout 600s;',
    slots => 'proxy_read_timeout 600s;'));

my ($a1, $b1, $a2) = @recorded;
my $r1 = replay($t, $a1);
is($r1->{status}, 200, 'Claude Code\'s first conversation: 200');
is_deeply([ grep { $_ ne 'content_block_delta' } @{ $r1->{types} } ],
          [ qw(message_start ping content_block_start content_block_stop
               message_delta message_stop) ],
          'an Anthropic stream') or diag $r1->{raw};
my $prompt = $r1->{input} + $r1->{cached};
cmp_ok($prompt, '>', 5000, "its prompt: $prompt tokens");
my ($base) = map { /base "base-\w+" primed .* saved: (\d+) tokens/ ? $1 : () }
             $t->log_lines(qr/primed/);
cmp_ok($base // 0, '>', 0.6 * $prompt,
       'its system prompt and tools made a base of ' . ($base // 0)
       . ' tokens');

my $rb = replay($t, $b1);
cmp_ok($rb->{cached}, '>=', 0.9 * ($base // 1e9),
       "a second conversation (its own cc_version) starts warm: "
       . "$rb->{cached} tokens cached of the first one's system prompt and "
       . 'tools (' . ($base // 0) . ')');

# four more conversations take the four slots
for my $sid (map { "other-$_" } 1 .. 4) {
    my $r = replay($t, $b1, sid => $sid);
    is($r->{status}, 200, "$sid: 200, $r->{cached} cached");
}

my $ra = replay($t, $a2);
cmp_ok($ra->{cached}, '>=', $prompt - 8,
       "the first conversation's next turn (--resume) comes back: "
       . "$ra->{cached} tokens cached of its first $prompt");
ok($t->log_lines(qr/in "d7059dad-[^"]*" restored/), 'by a restore');
ok(!$t->log_lines(qr/cannot pin/), 'nothing refused');
$t->stop;

# --- the CLI itself, against the fake backend ---------------------------

my $claude = `$LlamaTest::ROOT/rig/npm-agents.sh 2>/dev/null`;
chomp $claude;

SKIP: {
    skip 'rig/npm-agents.sh could not install Claude Code', 6 unless -x $claude;

    $t = LlamaTest->new(workers => 2);
    $t->fake(np => 4);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m slots=4 store=%%SLOTS%%;',
        server => 'llama_session_warm system;'));

    my $home = $t->dir . '/home';
    my $work = $t->dir . '/work';
    mkdir $_ for $home, $work;

    my $cli = sub {
        my @args = @_;
        my $cmd = join ' ', map { "'$_'" } $claude, '-p', '--output-format',
                  'json', '--model', 'claude-sonnet-4-5', '--max-turns', 1,
                  @args;
        my $out = `cd $work && env -i PATH=/usr/bin:/bin HOME=$home TERM=dumb \\
            ANTHROPIC_BASE_URL=http://127.0.0.1:$t->{nginx_port} \\
            ANTHROPIC_API_KEY=dummy CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \\
            DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 \\
            timeout 120 $cmd </dev/null 2>&1`;
        my $j = eval { $JSON->decode((grep { /^\{/ } split /\n/, $out)[-1]) };
        return ($j // {}, $out);
    };

    my ($j1, $o1) = $cli->('say hi');
    ok(!$j1->{is_error} && ($j1->{result} // '') =~ /tok/,
       "the CLI's first conversation is answered: '"
       . ($j1->{result} // '') . "'") or diag $o1;
    my ($j2, $o2) = $cli->('say hello');
    ok(!$j2->{is_error} && ($j2->{result} // '') =~ /tok/,
       'a second conversation is answered') or diag $o2;
    isnt($j2->{session_id} // '', $j1->{session_id} // '',
         'with a session of its own');
    my ($j3, $o3) = $cli->('--resume', $j1->{session_id} // 'none',
                           'and once more');
    ok(!$j3->{is_error} && ($j3->{result} // '') =~ /tok/,
       'the first one resumed is answered') or diag $o3;

    # the fake backend keeps no body of over 64 kB: Claude Code's are
    my @chat = grep { $_->{path} eq '/v1/chat/completions'
                      && $_->{body_len} > 65536 } @{ $t->fake_calls };
    ok(@chat >= 3, 'llama-server got its requests as chat completions, '
       . scalar(@chat));
    my $sid = substr($j1->{session_id} // 'none', 0, 32);
    ok($t->log_lines(qr/in "\Q$sid\E[^"]*" (fresh|restored|warm)/)
       && !$t->log_lines(qr/cannot pin/),
       'the module knew the conversation by its session id');
    $t->stop;
}

done_testing;
