#!/usr/bin/perl

# The re-prime before a save (reprime.c): the slot is made to hold exactly
# the prefix the session's next turn is certain to share (history + last
# reply as the client sends it back, rendered by the model's template),
# then saved.  A returning turn after a restore then reuses all of its
# history: with the idle save, with the swap (no idle save came first),
# across a restart of llama-server and nginx.  On a hybrid model (the
# rig's lfm2: without the re-prime a restore brings nothing) and a
# sliding-window one (gemma3 with --swa-full; without it the zone stops
# saving after one re-primed restore that brought nothing, and says why).
# Never on full attention (the rig's llama): the slot as it is holds all
# the next turn can reuse, and an idle save leaves it alone.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

# random weights: byte tokens make invalid UTF-8, which the chat parser
# refuses; ban them
my @ban = map { [ $_, JSON::PP::false ] } 3 .. 258;

my $system = join ' ', map { "Rule $_ holds for every answer." } 1 .. 60;

# more of every request's body, for a scenario (a grammar)
our %extra;

sub turn {
    my ($t, $id, $msgs, %o) = @_;
    my $body = { messages => $msgs, max_tokens => $o{max} // 24,
                 logit_bias => \@ban, seed => 1, %extra };
    $body->{stream} = JSON::PP::true if $o{stream};
    my $r;
    if ($o{stream}) {
        my ($status, $events, undef, $raw) =
            $t->stream('/v1/chat/completions', $body,
                       headers => { 'X-Session-Id' => $id });
        $r = { status => $status, events => $events, headers => $raw->{headers},
               content => $raw->{content} // '' };
    } else {
        $r = $t->post('/v1/chat/completions', $body,
                      headers => { 'X-Session-Id' => $id });
    }
    die "$id: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    return $r;
}

# what a stream or a reply says: the reply's text and the timings
sub reply_of {
    my ($r) = @_;
    return ($r->{json}{choices}[0]{message}{content} // '',
            $r->{json}{timings},
            $r->{json}{choices}[0]{message}{reasoning_content} // '')
        if $r->{json};
    my ($text, $timings, $reasoning) = ('', undef, '');
    for my $ev (@{ $r->{events} // [] }) {
        if ($ev->{choices} && @{ $ev->{choices} }) {
            $text .= $ev->{choices}[0]{delta}{content} // '';
            $reasoning .= $ev->{choices}[0]{delta}{reasoning_content} // '';
        }
        $timings = $ev->{timings} if $ev->{timings};
    }
    return ($text, $timings, $reasoning);
}

sub conversation_of {
    my ($who) = @_;
    return [ { role => 'system', content => $system },
             { role => 'user',
               content => join ' ', map { "$who keeps note $_." } 1 .. 40 } ];
}

# one model: a session's first turn, its save (idle or swap), another
# session on the slot, the returning turn restored; then a restart
sub scenario {
    my (%o) = @_;
    my $name = $o{name};
    local %extra = %{ $o{extra} // {} };

    my $t = LlamaTest->new(workers => 2);
    my $llama = $t->llama(model => $o{model}, args => $o{args} // []);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% '
              . ($o{idle} ? 'save_idle=300ms ' : '')
              . ($o{reprime} // '') . ';',
        location => 'proxy_read_timeout 300s;
                     add_header X-S-Action $llama_session_action always;',
        slots => 'proxy_read_timeout 300s;',
        extra => 'location = /metrics { llama_session_metrics; }'));

    my $a = conversation_of('Ann');
    my $r1 = turn($t, "ann-$name", $a, stream => $o{stream}, max => $o{max});
    my ($reply, $tm1, $reasoning) = reply_of($r1);
    # the first prompt's tokens: what the returning turn shares with it
    my $first = ($tm1->{cache_n} // 0) + ($tm1->{prompt_n} // 0);

    if ($o{idle}) {
        ok($t->wait_for(sub { $t->log_lines(qr/idle save of "ann-$name-\w+"/) }, 30),
           "$name: ann is saved while idle");
        # the turn file was there (the re-prime read it) and is gone, or
        # never written (full attention: no re-prime)
        is(scalar(grep { !/\.tmp$/ } glob($t->dir . '/slots/.turn.*')), 0,
           "$name: no turn file is left");
    }

    my $b = conversation_of('Bob');
    turn($t, "bob-$name", $b);

    my @re = $t->log_lines(qr/re-primed "ann-$name-\w+" on slot 0 of zone "llama" before its save: (-?\d+) tokens from the slot, (-?\d+) evaluated/);
    if ($o{reprime_off}) {
        is(scalar @re, 0, "$name: reprime=off: no re-prime");
    } elsif ($o{plain}) {
        is(scalar @re, 0, "$name: on full attention the "
                          . ($o{idle} ? 'idle save' : "client's swap")
                          . ' saves the slot as it is');
        like($t->get('/metrics')->{content},
             qr/^nginx_llama_session_reprimes_total\{zone="llama",result="ok"\} 0$/m,
             "$name: no re-prime counted");
    } else {
        is(scalar @re, 1, "$name: ann was re-primed once, before her "
                          . ($o{idle} ? 'idle save' : 'swap') . ": @re");
    }

    # the returning turn, as a client sends it: the reply as it came
    # (reasoning_back: with its reasoning, as a client that sends back the
    # message it got)
    push @$a, { role => 'assistant', content => $reply,
                $o{reasoning_back} && $reasoning ne ''
                  ? (reasoning_content => $reasoning) : () },
              { role => 'user', content => 'And then?' };
    my $r2 = turn($t, "ann-$name", $a);
    my (undef, $tm) = reply_of($r2);
    is($r2->{headers}{'x-s-action'}, 'restore', "$name: ann is restored");
    my $shared = $tm->{cache_n} + $tm->{prompt_n};
    $o{check}->($tm, "$name: returning turn $tm->{cache_n} cached, "
                     . "$tm->{prompt_n} evaluated", $first);

    # a restart of both: the saved file is all there is
    if ($o{restart}) {
        push @$a, { role => 'assistant', content => (reply_of($r2))[0] },
                  { role => 'user', content => 'Once more.' };
        turn($t, "bob-$name", $b);     # ann's turn is saved by this swap
        $t->stop_nginx;
        $t->stop_llama;
        $t->llama(port => $llama, model => $o{model}, args => $o{args} // []);
        $t->start_nginx;
        my $r3 = turn($t, "ann-$name", $a);
        my (undef, $t3) = reply_of($r3);
        is($r3->{headers}{'x-s-action'}, 'restore',
           "$name: after a restart ann is restored");
        ($o{check_restart} // $o{check})->($t3, "$name: after a restart "
                         . "$t3->{cache_n} cached, $t3->{prompt_n} evaluated");
    }

    if ($o{kind}) {
        like($t->get('/metrics')->{content},
             qr/^nginx_llama_session_model_memory\{zone="llama",kind="$o{kind}"\} 1$/m,
             "$name: the model's memory, from its file: $o{kind}");
    }
    ok(!$t->log_lines(qr/\[(?:error|crit|alert)\]/), "$name: no error logged");
    my @warn = $t->log_lines(qr/\[warn\].*llama_session/);
    $o{warns}->(@warn) if $o{warns};
    $t->stop;
}

# the new user message and the template's turn marks: what a turn that
# reuses all of its history still evaluates
my $all_but_new = sub {
    my ($tm, $what) = @_;
    cmp_ok($tm->{prompt_n}, '<=', 24, $what);
};

# a save on a full-attention model keeps the slot as it is (a re-prime
# could only cut it shorter than what the next turn shares): the returning
# turn evaluates the reply again (24 tokens, which random weights write as
# token sequences the tokenizer would not make) and the new message
my $all_but_reply = sub {
    my ($tm, $what) = @_;
    cmp_ok($tm->{prompt_n}, '<=', 70, $what);
};

# an idle save on full attention leaves the slot alone (it re-primed, and a
# render that differed from the client's next request cut a slot that was
# exactly right: 3,609 of 7,995 cached instead of 7,878)
scenario(name => 'llama', idle => 1, stream => 1, restart => 1, kind => 'full',
         plain => 1, check => $all_but_reply);
scenario(name => 'llamaswap', plain => 1, check => $all_but_reply);

# reprime=off on the full-attention model: restores still work, the
# reply's tokens are evaluated again (measured: 846 cached, 64 evaluated,
# against 889 and 21 with the re-prime)
scenario(name => 'llamaoff', reprime => 'reprime=off', reprime_off => 1,
         check => sub {
             cmp_ok($_[0]{cache_n}, '>', 500, $_[1]);
             cmp_ok($_[0]{prompt_n}, '>', 24,
                    'without the re-prime the reply is evaluated again');
         });

# the rig's hybrid model (short convolutions + attention): a restore is
# reused only when the next prompt extends all of the saved sequence
my $lfm2 = LlamaTest::rig_path('make-model.sh lfm2');
my $think = "$LlamaTest::ROOT/rig/templates/chatml-think.jinja";

scenario(name => 'lfm2', model => $lfm2, idle => 1, stream => 1, kind => 'hybrid',
         restart => 1, check => $all_but_new,
         warns => sub { ok(!grep(/llama_session/, @_),
                           'lfm2: no warning (' . scalar(@_) . ')') });
scenario(name => 'lfm2swap', model => $lfm2, check => $all_but_new);

# a reasoning template that drops the previous turn's thinking
scenario(name => 'lfm2think', model => $lfm2, stream => 1, restart => 1,
         args => [ '--jinja', '--chat-template-file', $think ],
         check => sub { cmp_ok($_[0]{prompt_n}, '<=', 30, $_[1]) });

# the same without the re-prime: the restored slot ends with the reply's
# thinking, which the next prompt no longer has: nothing is reused
scenario(name => 'lfm2thinkoff', model => $lfm2, reprime => 'reprime=off',
         reprime_off => 1,
         args => [ '--jinja', '--chat-template-file', $think ],
         check => sub { cmp_ok($_[0]{cache_n}, '<', 100, $_[1]) });

# sliding-window attention with --swa-full: re-primed files work
my $gemma3 = LlamaTest::rig_path('make-model.sh gemma3');

scenario(name => 'gemma3full', model => $gemma3, idle => 1, restart => 1,
         kind => 'swa',
         args => [ '--swa-full' ], check => $all_but_new,
         check_restart => $all_but_reply);
scenario(name => 'gemma3think', model => $gemma3, stream => 1,
         args => [ '--swa-full', '--jinja', '--chat-template-file', $think ],
         check => sub { cmp_ok($_[0]{prompt_n}, '<=', 30, $_[1]) });

# a client's swap on a sliding window, a reasoning template and a reply
# longer than the window (256 tokens): saved as the slot held it, the file
# ended with the reply's thinking, which the next prompt drops more than a
# window before the state's end: 0 cached on every return, and the zone
# concluded that llama-server ran without --swa-full and stopped saving
scenario(name => 'gemma3long', model => $gemma3, max => 300,
         args => [ '--swa-full', '--jinja', '--chat-template-file', $think ],
         check => sub { cmp_ok($_[0]{prompt_n}, '<=', 30, $_[1]) },
         warns => sub { ok(!grep(/runs without --swa-full/, @_),
                           'gemma3long: no --swa-full diagnosis') });

# a hybrid model with Nemotron 3's template (it renders a reply's reasoning
# in the history: "<think></think>" when there is none), a client that
# sends the reply back as it got it, reasoning included: the first return
# gave no history to tell, the re-prime rendered the reply without its
# reasoning and the file ran past what the next prompt shares: 0 cached
my $nemotron = LlamaTest::chat_template('NVIDIA-Nemotron-3-Nano-30B-A3B-BF16');

# (the cut stops after "<think>": the reply's reasoning is evaluated again)
my $all_the_prompt = sub {
    my ($tm, $what, $first) = @_;
    cmp_ok($tm->{cache_n}, '>=', $first - 4,
           "$what, the first prompt's $first tokens");
};
scenario(name => 'lfm2nemotron', model => $lfm2, reasoning_back => 1,
         args => [ '--jinja', '--chat-template-file', $nemotron ],
         check => $all_the_prompt);
scenario(name => 'lfm2nemotronidle', model => $lfm2, reasoning_back => 1,
         idle => 1,
         args => [ '--jinja', '--chat-template-file', $nemotron ],
         check => $all_the_prompt);

# gpt-oss's harmony template: no newline between messages
# ("...<|end|><|start|>user<|message|>..."), so a cut after the last
# newline of the renders fell back to the system prompt (117 of ~3,000
# reused); the cut on tokens keeps all the history
my $harmony = LlamaTest::chat_template('openai-gpt-oss-120b');

# llama-server parses a harmony reply: random weights must write one
my %final = (grammar => 'root ::= "<|channel|>final<|message|>" [a-z ]{8,60}');

scenario(name => 'harmony', stream => 1, restart => 1, extra => \%final,
         plain => 1,
         args => [ '--jinja', '--chat-template-file', $harmony ],
         check => $all_but_reply);
scenario(name => 'lfm2harmony', model => $lfm2, idle => 1, extra => \%final,
         args => [ '--jinja', '--chat-template-file', $harmony ],
         check => sub { cmp_ok($_[0]{prompt_n}, '<=', 30, $_[1]) });
scenario(name => 'gemma3harmony', model => $gemma3, extra => \%final,
         args => [ '--swa-full', '--jinja', '--chat-template-file', $harmony ],
         check => sub { cmp_ok($_[0]{prompt_n}, '<=', 30, $_[1]) });
# harmony on full attention, an idle save: the slot as it is
scenario(name => 'harmonyidle', idle => 1, extra => \%final, plain => 1,
         args => [ '--jinja', '--chat-template-file', $harmony ],
         check => $all_but_reply);

# warm starts: the base (the system prompt alone) restored from its file
# into a slot that held another system prompt is reused by a new
# conversation on every memory kind
# (on hybrid ones the base is made by the prefix prime, which ends where the
# conversation's first message starts)
sub warm_scenario {
    my (%o) = @_;
    my $name = $o{name};
    my $t = LlamaTest->new(workers => 2);
    my $llama = $t->llama(model => $o{model}, args => $o{args} // []);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
        server => 'llama_session_warm system min=64;',
        location => 'add_header X-S-Action $llama_session_action always;'));

    turn($t, "first-$name", conversation_of('Ann'));
    ok($t->wait_for(sub { $t->log_lines(qr/base "base-\w+" primed .* and saved: \d+ tokens/) }, 5),
       "$name: the first conversation made the base");

    # another system prompt takes the slot: the base must come from its file
    my $other = conversation_of('Eve');
    $other->[0]{content} = join ' ', map { "Law $_ binds each reply." } 1 .. 60;
    turn($t, "other-$name", $other);

    my $r = turn($t, "new-$name", conversation_of('Cy'));
    my (undef, $tm) = reply_of($r);
    is($r->{headers}{'x-s-action'}, 'warm', "$name: a new conversation starts warm");
    my ($base) = map { /warm from base "base-\w+", (\d+) tokens/ ? $1 : () }
                 $t->log_lines(qr/warm from base/);
    ok($base, "$name: from the base's file");
    # full attention and SWA: the base ends with the template's assistant
    # prompt, which the conversation replaces (a few tokens); hybrid: the
    # prefix prime's base ends where the conversation's first message starts
    cmp_ok($tm->{cache_n}, '>=', ($base // 1e9) - ($o{exact} ? 0 : 4),
           "$name: which it reuses: $tm->{cache_n} cached of the base's "
           . ($base // '?') . " tokens, $tm->{prompt_n} evaluated");
    $t->stop;
}

warm_scenario(name => 'llama');
warm_scenario(name => 'lfm2', model => $lfm2, exact => 1);
warm_scenario(name => 'lfm2think', model => $lfm2, exact => 1,
              args => [ '--jinja', '--chat-template-file', $think ]);
warm_scenario(name => 'gemma3', model => $gemma3, args => [ '--swa-full' ]);

# without --swa-full: the memory is said at start, three re-primed
# restores in a row that bring nothing stop saves and restores, with the
# fix in the log; llama-server restarted with --swa-full: they resume, and
# help
{
    my $t = LlamaTest->new(workers => 2);
    my $port = $t->llama(model => $gemma3);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
        location => 'add_header X-S-Action $llama_session_action always;',
        extra => 'location /api/ { llama_session_api llama; }'));

    my %c = (ann => conversation_of('Ann'), bob => conversation_of('Bob'));
    my %last;
    my $talk = sub {
        my ($who) = @_;
        my $c = $c{$who};
        push @$c, { role => 'assistant', content => $last{$who} },
                  { role => 'user', content => 'And then?' }
            if defined $last{$who};
        my $r = turn($t, "$who-swa", $c);
        ($last{$who}) = reply_of($r);
        return $r;
    };
    $talk->('ann');
    ok($t->log_lines(qr/the model of zone "llama" \(gemma3\) has sliding-window attention \(256 tokens\).*--swa-full/),
       'gemma3: its sliding window is said at start, with --swa-full');

    # ann, bob: first turns; then three restores, each re-primed, bring
    # nothing: the first two are counted, the third stops
    $talk->('bob');
    my @r = map { $talk->($_) } qw(ann bob);
    is_deeply([ map { $_->{headers}{'x-s-action'} } @r ],
              [ 'restore', 'restore' ], 'gemma3: ann and bob restored');
    ok(!$t->log_lines(qr/runs without --swa-full/),
       'gemma3: two restores that brought nothing: no stop yet');
    my $r = $talk->('ann');
    is($r->{headers}{'x-s-action'}, 'restore', 'gemma3: ann restored again');
    ok($t->wait_for(sub { $t->log_lines(qr/sliding-window attention and 3 restores in a row brought nothing: llama-server runs without --swa-full/) }, 5),
       'gemma3: the third stops saves, with the fix');

    my @before = glob($t->dir . '/slots/*.bin');
    $talk->('bob');
    my @after = glob($t->dir . '/slots/*.bin');
    is(scalar @after, scalar @before, 'gemma3: no file saved since');
    my $r2 = $talk->('ann');
    isnt($r2->{headers}{'x-s-action'}, 'restore', 'gemma3: no restore since');
    like($t->get('/api/sessions/current')->{content}, qr/"restores_disabled":true/,
         'gemma3: the API says restores are off');

    my $saves = () = $t->log_lines(qr/re-primed "bob-swa-\w+"/);
    $t->stop_llama;
    $t->llama(port => $port, model => $gemma3, args => [ '--swa-full' ]);
    $talk->('bob');
    ok($t->wait_for(sub { $t->log_lines(qr/llama-server of zone "llama" restarted: the zone saves and restores again/) }, 5),
       'gemma3: llama-server restarted, saves and restores resume');
    my $r3 = $talk->('ann');
    my (undef, $tm) = reply_of($r3);
    is($r3->{headers}{'x-s-action'}, 'restore',
       'gemma3 with --swa-full: ann restores her file');
    cmp_ok($tm->{cache_n}, '>=', 800, "gemma3 with --swa-full: and it helps: "
                                      . "$tm->{cache_n} cached");
    ok(scalar $t->log_lines(qr/re-primed "bob-swa-\w+"/) > $saves,
       'gemma3 with --swa-full: bob is saved again');
    like($t->get('/api/sessions/current')->{content}, qr/"restores_disabled":false/,
         'gemma3 with --swa-full: the API says restores are on');

    $t->stop;
}

# with --swa-full and reprime=off, a client that rewrote its history far
# behind the window: the restore brings nothing, and that is no sign of a
# missing --swa-full (saves go on)
{
    my $t = LlamaTest->new(workers => 2);
    $t->llama(model => $gemma3, args => [ '--swa-full' ]);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% '
              . 'reprime=off;',
        location => 'add_header X-S-Action $llama_session_action always;'));

    my $long = join ' ', map { "Ann keeps note $_." } 1 .. 100;
    my $a = [ { role => 'system', content => $system },
              { role => 'user', content => 'Hello, I am Ann.' },
              { role => 'assistant', content => 'Hello Ann.' },
              { role => 'user', content => $long } ];
    my ($reply) = reply_of(turn($t, 'ann-far', $a));
    turn($t, 'bob-far', conversation_of('Bob'));
    # the first note rewritten: some 600 tokens before the slot's end (the
    # first message, which names the conversation, stays)
    $a->[3]{content} =~ s/^Ann keeps note 1\./Ann kept note 1./;
    push @$a, { role => 'assistant', content => $reply },
              { role => 'user', content => 'And then?' };
    my $r = turn($t, 'ann-far', $a);
    my (undef, $tm) = reply_of($r);
    is($r->{headers}{'x-s-action'}, 'restore', 'gemma3 far: ann restored')
        or diag explain $r->{headers};
    # llama-server keeps no context checkpoint of a restored state: a
    # prompt that leaves it more than a window before its end is prefilled
    # whole, --swa-full or not
    is($tm->{cache_n}, 0, 'gemma3 far: the change lies beyond the window: '
                          . 'nothing is reused');
    ok(!$t->log_lines(qr/runs without --swa-full/),
       'gemma3 far: no --swa-full diagnosis');
    my @before = glob($t->dir . '/slots/*.bin');
    turn($t, 'bob-far', conversation_of('Bob'));
    my $r2 = turn($t, 'ann-far', $a);
    is($r2->{headers}{'x-s-action'}, 'restore',
       'gemma3 far: saves and restores go on');
    $t->stop;
}

done_testing;
