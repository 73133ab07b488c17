#!/usr/bin/perl

# The real chat templates of the model families people run (llama.cpp's
# models/templates, in the rig's tree), each on the memory kind its
# family comes with (full attention: the rig's llama; sliding window: the
# rig's gemma3 with --swa-full; hybrid: the rig's lfm2).  Sessions take
# turns on one slot, each sending its replies back as a kind of client
# does: ann the content alone (most clients), bob the message as it came,
# reasoning_content too (clients that push the SDK's message back).  (Tool
# calls: llama-server's tool grammars fail to start on the rig's vocabulary,
# "Failed to initialize samplers", so random weights write none; the
# re-prime's tool results are in t/13-faults.t on the fake backend.)  Every returning
# turn is restored, first by the client's swap (the next session's request
# right after the reply), then from the idle save's file, and must reuse
# at least 90 % of what its prompt shares with the session's previous one
# (tokens, from llama-server's own /apply-template and /tokenize).
# gpt-oss's harmony, which needs a grammar for random weights to write a
# reply llama-server parses, is in t/92-reprime.t on all three kinds.  A
# template llama-server cannot render for the rig's model is reported by
# name, and must be one of those known.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my %model = (
    full   => LlamaTest::llama_model(),
    swa    => LlamaTest::rig_path('make-model.sh gemma3'),
    hybrid => LlamaTest::rig_path('make-model.sh lfm2'),
);
my %args = (swa => [ '--swa-full' ]);

# family template => memory kind
my @matrix = (
    [ 'meta-llama-Llama-3.1-8B-Instruct',          'full' ],
    [ 'Qwen-Qwen3-0.6B',                           'full' ],
    [ 'Qwen3-Coder',                               'full' ],
    [ 'deepseek-ai-DeepSeek-R1-Distill-Qwen-32B',  'full' ],
    [ 'Mistral-Small-3.2-24B-Instruct-2506',      'full' ],
    [ 'unsloth-mistral-Devstral-Small-2507',       'full' ],
    [ 'GLM-4.6',                                   'full' ],
    [ 'microsoft-Phi-3.5-mini-instruct',           'full' ],
    [ 'moonshotai-Kimi-K2',                        'full' ],
    [ 'google-gemma-4-31B-it',                     'swa' ],
    [ 'Qwen3.5-4B',                                'hybrid' ],
    [ 'NVIDIA-Nemotron-3-Nano-30B-A3B-BF16',       'hybrid' ],
    [ 'ibm-granite-granite-4.0',                   'hybrid' ],
    [ 'LFM2.5-Instruct',                           'hybrid' ],
);

# TEMPLATES=a,b: only those (a test run by hand)
@matrix = grep { my $n = $_->[0]; grep { $_ eq $n } split /,/, $ENV{TEMPLATES} }
          @matrix if $ENV{TEMPLATES};

# templates llama-server cannot render for the rig's model (none known)
my %unrenderable = ();

# random weights: byte tokens make invalid UTF-8; ban them
my @ban = map { [ $_, JSON::PP::false ] } 3 .. 258;

my $system = join ' ', map { "Rule $_ holds for every answer." } 1 .. 40;

sub conversation {
    my ($who) = @_;
    return [ { role => 'system', content => $system },
             { role => 'user',
               content => join ' ', map { "$who keeps note $_." } 1 .. 60 } ];
}

sub body_of {
    my ($msgs) = @_;
    return { messages => $msgs, max_tokens => 16, logit_bias => \@ban,
             seed => 1 };
}

# the tokens of a request's prompt, as llama-server makes them
sub prompt_tokens {
    my ($t, $port, $body) = @_;
    my %b = %$body;
    delete @b{qw(max_tokens logit_bias seed)};
    my $r = $t->post('/apply-template', \%b, port => $port);
    return undef unless $r->{status} == 200 && defined $r->{json}{prompt};
    my $k = $t->post('/tokenize', { content => $r->{json}{prompt},
                                    add_special => JSON::PP::true,
                                    parse_special => JSON::PP::true },
                     port => $port);
    return $k->{status} == 200 ? $k->{json}{tokens} : undef;
}

sub common {
    my ($x, $y) = @_;
    my $n = 0;
    $n++ while $n < @$x && $n < @$y && $x->[$n] == $y->[$n];
    return $n;
}

# the reply sent back as the session's kind of client does, and its next
# message
sub answer {
    my ($style, $msgs, $m, $id) = @_;
    push @$msgs, { role => 'assistant', content => $m->{content} // '',
                   $style eq 'reasoning' && ($m->{reasoning_content} // '') ne ''
                     ? (reasoning_content => $m->{reasoning_content}) : () },
                 { role => 'user', content => "And then, $id?" };
}

my @cannot;

for my $case (@matrix) {
    my ($name, $kind) = @$case;
    my $file = LlamaTest::chat_template($name);
    my $t = LlamaTest->new(workers => 2);
    my $port = eval {
        $t->llama(model => $model{$kind}, ctx => 8192,
                  args => [ @{ $args{$kind} // [] }, '--jinja',
                            '--chat-template-file', $file ]) };
    if (!$port) {
        my $log = $t->read_file($t->dir . '/llama.log') // '';
        push @cannot, $name;
        diag("$name ($kind): llama-server does not start with it: $@"
             . substr($log, -400));
        ok($unrenderable{$name}, "$name: a known unrenderable template");
        $t->stop;
        next;
    }
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% '
              . 'save_idle=1s;',
        location => 'proxy_read_timeout 120s;
                     add_header X-S-Action $llama_session_action always;'));

    my %style = (ann => 'content', bob => 'reasoning');
    my @who = qw(ann bob);
    my %conv = map { $_ => conversation(ucfirst $_) } @who;
    my (%prev, @returns, $failed);

    # the swap: three rounds back to back; then each turn left to its idle
    # save before the next session's
    my @plan = ((map { [ $_, 'swap' ] } (@who) x 3),
                (map { [ $_, 'idle' ] } (@who) x 2));

    TURN:
    for my $step (@plan) {
        my ($id, $path) = @$step;
        my $body = body_of($conv{$id});
        my $tokens = $prev{$id} && prompt_tokens($t, $port, $body);
        my $idle_before = () = $t->log_lines(qr/idle save of "$id-\w+"/);
        my $r = $t->post('/v1/chat/completions', $body,
                         headers => { 'X-Session-Id' => $id });
        if ($r->{status} != 200) {
            $failed = "$id: $r->{status} " . substr($r->{content} // '', 0, 200);
            last TURN;
        }
        my $tm = $r->{json}{timings} // {};
        my $action = $r->{headers}{'x-s-action'} // '';
        if ($prev{$id}) {
            push @returns, { id => $id, path => $prev{$id}{path},
                             action => $action, cached => $tm->{cache_n} // 0,
                             all => ($tm->{cache_n} // 0)
                                    + ($tm->{prompt_n} // 0),
                             shared => $tokens
                                       ? common($prev{$id}{tokens}, $tokens)
                                       : undef };
        }
        $prev{$id} = { tokens => prompt_tokens($t, $port, $body),
                       path => $path };
        answer($style{$id}, $conv{$id}, $r->{json}{choices}[0]{message}, $id);
        if ($path eq 'idle') {
            $t->wait_for(sub {
                my $n = () = $t->log_lines(qr/idle save of "$id-\w+"/);
                $n > $idle_before }, 20)
                or diag("$name: $id was not saved while idle");
        }
    }

    if ($failed) {
        push @cannot, $name;
        diag("$name ($kind): llama-server cannot render it for the rig's "
             . "model: $failed");
        ok($unrenderable{$name}, "$name: a known unrenderable template");
        $t->stop;
        next;
    }

    my %paths = map { $_->{path} => 1 } @returns;
    is(scalar @returns, 4 * @who, "$name ($kind): every return measured");
    ok($paths{swap} && $paths{idle}, "$name: returns by both swap paths");
    for my $x (@returns) {
        my $what = sprintf('%s (%s): %s (%s) after its %s save: %d cached '
                           . 'of %d, %s shared with its previous prompt',
                           $name, $kind, $x->{id}, $style{$x->{id}},
                           $x->{path}, $x->{cached}, $x->{all},
                           $x->{shared} // '?');
        is($x->{action}, 'restore', "$what: restored");
        ok(defined $x->{shared} && $x->{cached} >= 0.9 * $x->{shared},
           "$what: at least 90 %");
    }
    ok(!$t->log_lines(qr/\[(?:error|crit|alert)\]/), "$name: no error");
    ok(!$t->log_lines(qr/saved without a re-prime/),
       "$name: no re-prime failed");
    ok(!$t->log_lines(qr/the zone stops saving and restoring for backend/),
       "$name: saves never stopped");
    $t->stop;
}

note('not renderable: ' . (join(', ', @cannot) || 'none'));

done_testing;
