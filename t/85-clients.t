#!/usr/bin/perl

# Real clients with their own libraries (examples/clients, the official
# npm packages installed by rig/npm-clients.sh): the OpenAI SDK with
# prompt_cache_key and with a session header through defaultHeaders, Open
# WebUI's headers and its title requests, the Anthropic SDK as Claude Code
# and as an app with its own header.  Two conversations take turns on one
# slot; each returning turn finds its whole cache.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $modules = `$LlamaTest::ROOT/rig/npm-clients.sh 2>/dev/null`;
chomp $modules;
-d $modules or BAIL_OUT("rig/npm-clients.sh failed: run 'make rig'");

my $t = LlamaTest->new(workers => 2);
$t->llama(np => 1, ctx => 8192);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    location => 'proxy_read_timeout 300s;',
    slots => 'proxy_read_timeout 300s;'));

# the examples run from a folder of their own, beside the packages
my $dir = $t->dir . '/clients';
mkdir $dir;
system('cp', glob("$LlamaTest::ROOT/examples/clients/*.mjs"), $dir) == 0 or die;
symlink $modules, "$dir/node_modules" or die;

my $base = 'http://127.0.0.1:' . $t->{nginx_port};

sub client {
    my ($script, @args) = @_;
    local $ENV{LLAMA_BASE_URL} = "$base/v1";
    local $ENV{ANTHROPIC_BASE_URL} = $base;
    my $out = `node $dir/$script @args 2>&1`;
    my $turns = eval { $LlamaTest::JSON->decode((split /\n/, $out)[-1]) };
    ok($turns, "$script @args ran") or diag $out;
    return $turns // [];
}

sub returns {
    my ($name, $turns, $size) = @_;
    my ($a1, $b1, $a2, $b2) = @$turns;
    for my $p ([ $a1, $a2 ], [ $b1, $b2 ]) {
        my ($first, $again) = @$p;
        ok($again->{cached} >= $first->{$size} - 1,
           "$name: $first->{id} returns after the other took the slot: "
           . "$again->{cached} tokens cached (its first turn had "
           . "$first->{$size})");
    }
}

returns('OpenAI SDK, prompt_cache_key', client('openai.mjs', 'key'), 'prompt');
returns('OpenAI SDK, X-Session-Id in defaultHeaders',
        client('openai.mjs', 'header'), 'prompt');
returns('Open WebUI\'s headers and title requests', client('openwebui.mjs'),
        'prompt');

my $an = client('anthropic.mjs');
my ($a1, $b1, $a2, $b2) = @$an;
ok($a2->{cached} >= $a1->{input} + $a1->{cached} - 1,
   "Anthropic SDK as Claude Code (X-Claude-Code-Session-Id): $a2->{cached} "
   . "tokens read from the cache");
ok($b2->{cached} >= $b1->{input} + $b1->{cached} - 1,
   "Anthropic SDK with an app's X-Session-Id: $b2->{cached}");

ok($t->log_lines(qr/in "chat-a-[0-9a-f]{24}" restored/),
   'the OpenAI conversations were swapped and restored, by their ids');

$t->stop;
done_testing;
