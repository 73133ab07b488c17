#!/usr/bin/perl

# The heart of it, against a real llama-server with one slot: sessions A
# and B take turns (A B A B A) with a long shared system prompt and their
# own history; every return to A finds A's whole previous prompt in the
# cache (restored from its file), where llama-server alone reuses only the
# shared prefix.  Also: a client that leaves mid-stream.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
my $llama = $t->llama;

$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    upstream => 'keepalive 4;',
    location => q{
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_buffering off;
        proxy_read_timeout 300s;
        add_header X-S-Action $llama_session_action always;
        add_header X-S-Slot $llama_session_slot always;
        add_header X-S-Swap $llama_session_swap_ms always;
    }));

my $system = join ' ', map { "Rule $_: keep answers short and cite section $_." }
                       1 .. 150;
my %history = (
    A => join(' ', map { "Alpha fact $_ is about rivers and bridges." } 1 .. 40),
    B => join(' ', map { "Bravo note $_ concerns engines and gears." } 1 .. 40),
);

# one turn of a conversation: returns (prompt tokens, cached tokens, action)
sub turn {
    my ($conv, $sid, %o) = @_;

    $conv->{n}++;
    push @{ $conv->{messages} },
        { role => 'user',
          content => $conv->{n} == 1 ? "$history{$sid} Question 1?"
                                     : "Next question $conv->{n}?" };

    my $r = $t->post('/v1/chat/completions',
                     { messages => $conv->{messages}, max_tokens => 4,
                       temperature => 0, seed => 1 },
                     headers => { 'X-Session-Id' => "conv-$sid" },
                     $o{port} ? (port => $o{port}) : ());
    die "turn failed: $r->{status} $r->{content}\n" unless $r->{status} == 200;

    push @{ $conv->{messages} },
        { role => 'assistant',
          content => $r->{json}{choices}[0]{message}{content} };

    $conv->{last} = $r->{headers};

    return ($r->{json}{usage}{prompt_tokens},
            $r->{json}{usage}{prompt_tokens_details}{cached_tokens},
            $r->{headers}{'x-s-action'});
}

my $last_headers;

sub run_sequence {
    my (%o) = @_;
    my %conv = map { $_ => { messages => [ { role => 'system',
                                             content => $system } ],
                             n => 0 } } qw(A B);
    my (@log, %prev);
    for my $sid (qw(A B A B A)) {
        my ($prompt, $cached, $action) = turn($conv{$sid}, $sid, %o);
        $last_headers = $conv{$sid}{last};
        push @log, { sid => $sid, prompt => $prompt, cached => $cached,
                     prev => $prev{$sid}, action => $action };
        $prev{$sid} = $prompt;
    }
    return @log;
}

# through nginx and the module
my @with = run_sequence();

is($with[0]{action}, 'fresh', 'A starts fresh');
is($with[1]{action}, 'warm', 'B starts warm: from the system prompt it '
   . 'shares with A');
cmp_ok($with[1]{cached}, '>', 1500, "B's first turn finds the system prompt "
       . "cached ($with[1]{cached} tokens)");
cmp_ok($with[0]{prompt}, '>', 1500, 'a long prompt: ' . $with[0]{prompt}
       . ' tokens');

for my $i (2 .. 4) {
    my $s = $with[$i];
    is($s->{action}, 'restore', "turn $i: $s->{sid} is restored");
    cmp_ok($s->{cached}, '>=', $s->{prev} - 4,
           "turn $i: $s->{sid} finds its whole previous prompt "
           . "($s->{cached} cached of $s->{prev})");
}

is($last_headers->{'x-s-slot'}, '0', '$llama_session_slot is the slot');
like($last_headers->{'x-s-swap'}, qr/^\d+$/, '$llama_session_swap_ms is set');
ok($t->log_lines(qr/llama_session: swap .* in "conv-A-\w+" restored \d+ tokens, \d+ bytes in [\d.]+ ms, (\d+) ms in all/),
   'the swap line has the time of the whole swap');

my @files = map { s{.*/}{}r } glob($t->dir . '/slots/*.bin');
ok((grep { /^conv-A-[0-9a-f]{24}\.[0-9a-f]{8}\.bin$/ } @files), 'A has a file');
ok((grep { /^conv-B-[0-9a-f]{24}\.[0-9a-f]{8}\.bin$/ } @files), 'B has a file');
cmp_ok(-s (glob($t->dir . '/slots/conv-A-*.bin'))[0], '>', 1_000_000,
       'the file holds the KV cache');
my @swaps = $t->log_lines(qr/llama_session: swap on slot 0/);
is(scalar @swaps, 5, 'five swaps in the error log');
like($swaps[-1], qr/out "conv-B-\w+" saved \d+ tokens, \d+ bytes in [\d.]+ ms, in "conv-A-\w+" restored \d+ tokens/,
     'a swap line tells what went out and in');

# the native API: timings.cache_n
my (%text, %evaluated);
for my $sid (qw(A B A B)) {
    $text{$sid} //= "$system $history{$sid}";
    $text{$sid} .= " And then $sid went on.";
    my $r = $t->post('/completion', { prompt => $text{$sid}, n_predict => 2,
                                      temperature => 0 },
                     headers => { 'X-Session-Id' => "native-$sid" });
    is($r->{status}, 200, "native $sid");
    if ($evaluated{$sid}) {
        cmp_ok($r->{json}{timings}{cache_n}, '>=', $evaluated{$sid} - 4,
               "native $sid: timings.cache_n $r->{json}{timings}{cache_n} "
               . "covers its previous prompt of $evaluated{$sid}");
    }
    $evaluated{$sid} = $r->{json}{tokens_evaluated};
}

# the same sequence straight to llama-server: only the shared prefix
my $plain = $t->llama(name => 'plain', slots => $t->dir . '/plain-slots');
my @without = run_sequence(port => $plain);
for my $i (2 .. 4) {
    my $s = $without[$i];
    cmp_ok($s->{cached}, '<', $s->{prev} - 100,
           "llama-server alone, turn $i: only the shared prefix "
           . "($s->{cached} cached of $s->{prev})");
    cmp_ok($with[$i]{cached}, '>', $s->{cached} + 100,
           "turn $i: the module keeps more in the cache than llama-server "
           . 'alone');
}
$t->stop_llama('plain');

# a client that leaves mid-stream: the slot is freed, the session is kept
my $s = $t->raw_open('POST', '/v1/chat/completions',
                     { messages => [ { role => 'system', content => $system },
                                     { role => 'user', content => 'Stream C' } ],
                       max_tokens => 400, temperature => 0, stream => \1 },
                     headers => { 'X-Session-Id' => 'conv-C' });
my $got = '';
while (defined(my $l = <$s>)) {
    $got .= $l;
    last if $got =~ /data: \{/;
}
like($got, qr/200 OK/, 'a stream started');
close $s;

my %conv = (messages => [ { role => 'system', content => $system } ], n => 0);
my ($prompt, $cached, $action) = turn(\%conv, 'A');
is($action, 'restore', 'A is restored after the stream left');
ok($t->wait_for(sub { glob($t->dir . '/slots/conv-C-*.bin') }, 5),
   'the stream\'s session was saved when the slot changed hands');

$t->stop;
done_testing;
