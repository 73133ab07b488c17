#!/usr/bin/perl

# Speculative decoding with a draft model (-md): llama-server's slot files
# hold the target model's context alone.  A restore into a slot whose draft
# context is longer than the restored state failed every later request of
# the session with 500 ("failed to process speculative batch"); the module
# erases such a slot before each restore (GET /slots says "speculative").
# The rig's model is its own draft (random weights accept nothing from
# another model).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
my $model = LlamaTest::llama_model();
$t->llama(np => 1, ctx => 8192,
          args => [ '-md', $model, '--spec-type', 'draft-simple' ]);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    location => 'add_header X-S-Action $llama_session_action always;'));

my $long = join ' ', map { "word$_" } 1 .. 600;

sub ask {
    my ($id, $prompt) = @_;
    return $t->post('/completion', { prompt => $prompt, n_predict => 8,
                                     temperature => 0 },
                    headers => { 'X-Session-Id' => $id });
}

my @status;
for my $round (1 .. 3) {
    my $r = ask('long', "$long round $round");
    push @status, $r->{status};
    is($r->{status}, 200, "round $round: the long session ("
                          . ($r->{headers}{'x-s-action'} // '') . ')');
    if ($round > 1) {
        is($r->{headers}{'x-s-action'}, 'restore', "round $round: restored");
        cmp_ok($r->{json}{timings}{cache_n} // 0, '>', 1000,
               "round $round: from its file: "
               . ($r->{json}{timings}{cache_n} // 0) . ' tokens cached');
    }
    $r = ask('short', "hello $round");
    is($r->{status}, 200, "round $round: a short session takes the slot");
}
ok($t->log_lines(qr/llama-server runs speculative decoding \(a draft model\) for zone "llama"/),
   'the log says what a draft model means for restores, once');
is(scalar($t->log_lines(qr/runs speculative decoding/)), 1, 'once');

$t->stop;

# the calls, on the fake backend: an erase right before each restore, on a
# speculative slot only; the API's restore-free paths untouched
for my $spec (1, 0) {
    my $f = LlamaTest->new(workers => 1);
    $f->fake(np => 1, script => { speculative => $spec });
    $f->nginx($f->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;'));
    for my $id (qw(a b a b)) {
        is($f->post('/completion', { prompt => "$id " x 50, n_predict => 2 },
                    headers => { 'X-Session-Id' => $id })->{status}, 200,
           "fake, speculative $spec: $id");
    }
    my @actions = map { $_->{query} =~ /action=(\w+)/ ? $1 : () }
                  grep { $_->{path} =~ m{^/slots/} } @{ $f->fake_calls };
    # (a new session on a slot that held another starts from an erase)
    is("@actions", $spec ? 'erase save erase save erase restore save erase restore'
                         : 'erase save erase save restore save restore',
       "fake, speculative $spec: the slot actions: @actions");
    $f->stop;
}

# the cost of a restore counts the draft's lost help (cost.c): the fake
# says 16 tokens a turn at 1 ms each, and at 400 ms each on a slot restored
# since its last erase; the file restores in 0.5 ms, the prompt (~6,400
# "tokens" at 0.5 ms) prefills in ~3.2 s.  Once the module has learnt both
# speeds, a returning session is re-prefilled (its draft whole again)
# instead of restored; without a draft model it is restored every time
for my $spec (1, 0) {
    my $f = LlamaTest->new(workers => 1);
    $f->fake(np => 1, script => { speculative => $spec,
                                  draft => { ms => 1, lost_ms => 400 } });
    $f->nginx($f->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
        location => 'add_header X-S-Action $llama_session_action always;'));
    my %conv;
    my $turn = sub {
        my ($sid) = @_;
        my $c = $conv{$sid} //= [ { role => 'user',
                                    content => "$sid " . ('history ' x 800) } ];
        push @$c, { role => 'user', content => 'more ' . scalar(@$c) };
        my $r = $f->post('/v1/chat/completions', { messages => $c },
                         headers => { 'X-Session-Id' => $sid });
        push @$c, { role => 'assistant', content => 'ok' };
        return $r->{status} == 200 ? $r->{headers}{'x-s-action'} : $r->{status};
    };
    $turn->($_) for qw(a b c);
    my @r = map { $turn->($_) } qw(a b c a b c);
    if ($spec) {
        is("@r[0 .. 2]", 'restore restore restore',
           "draft cost: restores while the speeds are learnt: @r");
        ok((grep { $_ eq 'fresh' } @r[3 .. 5]),
           'then a returning session is re-prefilled, its draft whole');
        ok($f->log_lines(qr/fresh \(re-prefilled: its file would take ~\d+ ms to restore/),
           'the swap line says why');
    } else {
        is("@r", join(' ', ('restore') x 6),
           "no draft model: every return restored: @r");
    }
    $f->stop;
}

done_testing;
