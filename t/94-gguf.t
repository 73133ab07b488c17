#!/usr/bin/perl

# The model's memory from its GGUF file (gguf.c), for files the rig's
# models do not show: a recurrent architecture, a sliding window, a file
# that is not the backend's model (another embedding size), and files cut
# short or lying about their sizes, which must leave the memory unknown
# without harm.  The fake backend names each file as /props's model_path.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

# a GGUF v3 header with these keys; no tensors
sub gguf {
    my (@kv) = @_;
    my $out = 'GGUF' . pack('V', 3) . pack('Q<', 0) . pack('Q<', @kv / 3);
    while (my ($k, $type, $v) = splice @kv, 0, 3) {
        $out .= pack('Q<', length $k) . $k . pack('V', $type);
        if ($type == 8) { $out .= pack('Q<', length $v) . $v }
        elsif ($type == 4) { $out .= pack('V', $v) }
        elsif ($type == 9) {                     # an array of u32
            $out .= pack('V', 4) . pack('Q<', scalar @$v) . pack('V*', @$v);
        }
    }
    return $out;
}

my $files = LlamaTest->new;
my $dir = $files->dir;
sub file {
    my ($name, $data) = @_;
    my $path = "$dir/$name";
    open my $fh, '>:raw', $path or die;
    print $fh $data;
    close $fh;
    chmod 0644, $path;
    return $path;
}

my %files = (
    recurrent => [ file('mamba.gguf', gguf(
        'general.architecture', 8, 'mamba2',
        'mamba2.embedding_length', 4, 256,
        'mamba2.attention.head_count', 4, 0,
        'mamba2.ssm.state_size', 4, 64,
        'tokenizer.ggml.model', 8, 'llama')), 'recurrent' ],
    hybrid => [ file('granite.gguf', gguf(
        'general.architecture', 8, 'granitehybrid',
        'granitehybrid.embedding_length', 4, 256,
        'granitehybrid.attention.head_count_kv', 9, [ 0, 0, 8, 0 ],
        'granitehybrid.ssm.conv_kernel', 4, 4)), 'hybrid' ],
    swa => [ file('gpt-oss.gguf', gguf(
        'general.architecture', 8, 'gpt-oss',
        'gpt-oss.embedding_length', 4, 256,
        'gpt-oss.attention.sliding_window', 4, 128)), 'swa' ],
    # the keys in another order (another tool, a merge): the model's after
    # the tokenizer's, or before general.architecture
    late => [ file('late.gguf', gguf(
        'general.architecture', 8, 'gemma3',
        'tokenizer.ggml.model', 8, 'llama',
        'gemma3.embedding_length', 4, 256,
        'gemma3.attention.sliding_window', 4, 512)), 'swa' ],
    early2 => [ file('early2.gguf', gguf(
        'granitehybrid.attention.head_count_kv', 9, [ 0, 0, 8, 0 ],
        'granitehybrid.ssm.conv_kernel', 4, 4,
        'granitehybrid.embedding_length', 4, 256,
        'general.architecture', 8, 'granitehybrid')), 'hybrid' ],
    other => [ file('other.gguf', gguf(
        'general.architecture', 8, 'llama',
        'llama.embedding_length', 4, 4096)), 'unknown' ],
    cut => [ file('cut.gguf', substr(gguf(
        'general.architecture', 8, 'gemma3',
        'gemma3.attention.sliding_window', 4, 512), 0, 40)), 'unknown' ],
    liar => [ file('liar.gguf', 'GGUF' . pack('V', 3) . pack('Q<', 0)
                   . pack('Q<', 1e12) . pack('Q<', 2 ** 60) . 'x' x 64),
              'unknown' ],
    missing => [ "$dir/none.gguf", 'unknown' ],
);

for my $case (sort keys %files) {
    my ($path, $kind) = @{ $files{$case} };
    my $t = LlamaTest->new(workers => 1);
    $t->fake(model => $path, meta => { n_vocab => 32000, size => 1000000,
                                       n_embd => 256 });

    # a turn file an earlier nginx left: a new zone vouches for no turn
    my $stale = $t->dir . '/slots/.turn.llama.0';
    open my $fh, '>', $stale or die;
    print $fh qq({"seq":1,"key":"old"}\n{});
    close $fh;

    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
        upstream => '',
        extra => 'location = /metrics { llama_session_metrics; }
                  location /api/ { llama_session_api llama; }'));
    ok(!-e $stale, "$case: the stale turn file went at start");
    my $r = $t->post('/v1/chat/completions',
                     { messages => [ { role => 'user', content => 'hi' } ] },
                     headers => { 'X-Session-Id' => 'g' });
    is($r->{status}, 200, "$case: served");
    like($t->get('/metrics')->{content},
         qr/^nginx_llama_session_model_memory\{zone="llama",kind="$kind"\} 1$/m,
         "$case: the metrics say $kind");
    my $mem = $t->get('/api/sessions/current')->{json}{backend}{memory};
    is($mem && $mem->{kind}, $kind, "$case: the API says $kind");
    if ($case eq 'swa') {
        is($mem->{sliding_window}, 128, "$case: with its window");
        ok($t->log_lines(qr/\(gpt-oss\) has sliding-window attention \(128 tokens\)/),
           "$case: said at start, with the fix");
    }
    if ($case eq 'late') {
        is($mem->{sliding_window}, 512, "$case: the window after the tokenizer's keys");
    }
    if ($case eq 'other') {
        ok($t->log_lines(qr/is not the model of zone "llama" \(embedding 4096, llama-server's 256\)/),
           "$case: another model's file is told apart");
    }
    $t->stop;
}

$files->stop;
done_testing;
