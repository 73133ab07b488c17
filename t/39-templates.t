#!/usr/bin/perl

# The real chat templates of the model families people run (llama.cpp's
# models/templates, in the rig's tree), each on the memory kind its
# family comes with (full attention: the rig's llama; sliding window: the
# rig's gemma3 with --swa-full; hybrid: the rig's lfm2).  Two sessions take
# turns on one slot; every returning turn is restored and must find at
# least 95 % of its prompt cached: the re-prime cuts on tokens, so no
# template's layout moves the cut.  gpt-oss's harmony, which needs a
# grammar for random weights to write a reply llama-server parses, is in
# t/92-reprime.t on all three kinds.  A template llama-server cannot render
# for the rig's model is reported by name, and must be one of those known.

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

my @cannot;

for my $case (@matrix) {
    my ($name, $kind) = @$case;
    my $file = LlamaTest::chat_template($name);
    my $t = LlamaTest->new(workers => 2);
    if (!eval { $t->llama(model => $model{$kind}, ctx => 8192,
                          args => [ @{ $args{$kind} // [] }, '--jinja',
                                    '--chat-template-file', $file ]); 1 })
    {
        my $log = $t->read_file($t->dir . '/llama.log') // '';
        push @cannot, $name;
        diag("$name ($kind): llama-server does not start with it: $@"
             . substr($log, -400));
        ok($unrenderable{$name}, "$name: a known unrenderable template");
        $t->stop;
        next;
    }
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
        location => 'proxy_read_timeout 120s;
                     add_header X-S-Action $llama_session_action always;'));

    my %conv = (ann => conversation('Ann'), bob => conversation('Bob'));
    my (@reuse, $failed, %last);

    TURN:
    for my $id (qw(ann bob ann bob ann)) {
        my $r = $t->post('/v1/chat/completions',
                         { messages => $conv{$id}, max_tokens => 16,
                           logit_bias => \@ban, seed => 1 },
                         headers => { 'X-Session-Id' => $id });
        if ($r->{status} != 200) {
            $failed = "$r->{status} " . substr($r->{content} // '', 0, 200);
            last TURN;
        }
        my $tm = $r->{json}{timings} // {};
        my $all = ($tm->{cache_n} // 0) + ($tm->{prompt_n} // 0);
        if (($r->{headers}{'x-s-action'} // '') eq 'restore') {
            push @reuse, [ $tm->{cache_n} // 0, $all, $last{$id} ];
        }
        $last{$id} = $all;
        push @{ $conv{$id} },
            { role => 'assistant',
              content => $r->{json}{choices}[0]{message}{content} // '' },
            { role => 'user', content => "And then, $id?" };
    }

    if ($failed) {
        push @cannot, $name;
        diag("$name ($kind): llama-server cannot render it for the rig's "
             . "model: $failed");
        ok($unrenderable{$name}, "$name: a known unrenderable template");
        $t->stop;
        next;
    }

    is(scalar @reuse, 3, "$name ($kind): three returning turns restored");
    for my $i (0 .. $#reuse) {
        my ($cached, $all, $before) = @{ $reuse[$i] };
        my $what = "$name ($kind): return " . ($i + 1) . ": $cached of $all "
                 . sprintf('tokens cached (%.1f %%)', 100 * $cached / $all);
        if ($kind eq 'hybrid') {
            # re-primed before each swap: all the history, the reply too
            cmp_ok($cached, '>=', 0.95 * $all, $what);
        } else {
            # saved as the slot held it: the previous prompt, then
            # the reply as generated, which random weights write as token
            # sequences the tokenizer would not make (a real model's
            # reply is reused too)
            # (a reasoning template renders the generation prompt's
            # opening of the thinking otherwise in the history)
            cmp_ok($cached, '>=', $before - 8, "$what, the $before tokens of "
                                               . 'the previous prompt');
        }
    }
    ok(!$t->log_lines(qr/\[(?:error|crit|alert)\]/), "$name: no error");
    ok(!$t->log_lines(qr/saved without a re-prime/),
       "$name: no re-prime failed");
    $t->stop;
}

note('not renderable: ' . (join(', ', @cannot) || 'none'));

done_testing;
