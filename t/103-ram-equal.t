#!/usr/bin/perl

# The RAM tier (ram=) under concurrency and with a draft model.
#
# Upstream 27148: with llama-server's RAM cache on, replies under
# concurrency were reported carrying another conversation's content.  Six
# conversations on two slots, all at once, three turns each, at
# temperature 0: every reply is the one the same conversation gets replayed
# alone, straight to llama-server with nothing cached (its first token and
# that token's log-probability; a reply computed over another
# conversation's state differs by far more than the drift of a cached
# prefix).
#
# A draft model (-md) keeps its state in a RAM entry, not in a slot file:
# draft tokens accepted on a turn kept in its slot, after a swap through
# RAM, and after a restore from a file.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $site = LlamaTest->site(
    zone => 'llama_session_zone zone=llama:1m slots=2 store=%%SLOTS%% '
          . 'ram=256m;',
    location => 'add_header X-S-Action $llama_session_action always;');

sub body {
    my ($msgs) = @_;
    return { messages => $msgs, max_tokens => 3, temperature => 0,
             logprobs => JSON::PP::true(), top_logprobs => 3 };
}

sub first_token {
    my ($json) = @_;
    my $lp = $json->{choices}[0]{logprobs}{content}[0] // {};
    return ($lp->{token} // '', $lp->{logprob} // 0);
}

{
    my $t = LlamaTest->new(workers => 2);
    $t->llama(np => 2, ctx => 8192, cache_ram => 256, sps => 0.1);
    $t->nginx($site);

    my @ids = map { "c$_" } 0 .. 5;
    my %conv = map {
        my $id = $_;
        ($id => [ { role => 'system', content => join ' ',
                    map { "Rule $_ of house $id." } 1 .. 30 },
                  { role => 'user', content => "Tell $id about $id." } ])
    } @ids;
    my (%turns, %actions);

    for my $round (1 .. 3) {
        my %h = map { $_ => $t->async_post('/v1/chat/completions',
                                           body($conv{$_}),
                                           headers => { 'X-Session-Id' => $_ })
                    } @ids;
        for my $id (@ids) {
            my $r = $t->async_wait($h{$id});
            is($r->{status}, 200, "round $round: $id answered");
            my $text = $r->{json}{choices}[0]{message}{content} // '';
            push @{ $turns{$id} }, { msgs => [ @{ $conv{$id} } ],
                                     text => $text,
                                     first => [ first_token($r->{json}) ] };
            $actions{ $r->{headers}{'x-s-action'} // '' }++;
            push @{ $conv{$id} }, { role => 'assistant', content => $text },
                                  { role => 'user',
                                    content => "And then, $id, round $round?" };
        }
    }
    cmp_ok($actions{ram} // 0, '>=', 2,
           'returns came out of RAM under concurrency: '
           . join ', ', map { "$_ $actions{$_}" } sort keys %actions);

    # each conversation alone, straight to llama-server, nothing cached
    my ($same, $all) = (0, 0);
    for my $id (@ids) {
        for my $k (0 .. $#{ $turns{$id} }) {
            my $turn = $turns{$id}[$k];
            my $r = $t->post('/v1/chat/completions',
                             { %{ body($turn->{msgs}) },
                               cache_prompt => JSON::PP::false() },
                             port => $t->{llama_port}{llama});
            my ($tok, $lp) = first_token($r->{json});
            my $text = $r->{json}{choices}[0]{message}{content} // '';
            $all++;
            $same++ if $text eq $turn->{text};
            ok($tok eq $turn->{first}[0]
               && abs($lp - $turn->{first}[1]) < 5e-3,
               "$id turn " . ($k + 1) . ": the reply's first token is the "
               . "one it gets alone ($tok $lp against "
               . "@{ $turn->{first} })");
        }
    }
    is($same, $all, "every reply's text is the one it gets alone "
                    . "($same of $all)");
    $t->stop;
}

# a draft model: the rig's model is its own draft (random weights accept
# nothing from another model)
my $model = LlamaTest::llama_model();
my $long = join ' ', map { "word$_" } 1 .. 400;
my %accepted;

for my $tier ('ram', 'files') {
    my $t = LlamaTest->new(workers => 1);
    $t->llama(np => 1, ctx => 8192,
              $tier eq 'ram' ? (cache_ram => 256, sps => 0.1)
                             : (cache_ram => 0),
              args => [ '-md', $model, '--spec-type', 'draft-simple' ]);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%'
              . ($tier eq 'ram' ? ' ram=256m;' : ';'),
        location => 'add_header X-S-Action $llama_session_action always;'));
    my %n;
    my $ask = sub {
        my ($id) = @_;
        my $r = $t->post('/completion',
                         { prompt => "$id: $long" . (' more' x ++$n{$id}),
                           n_predict => 16, temperature => 0 },
                         headers => { 'X-Session-Id' => $id });
        is($r->{status}, 200, "$tier: $id answered");
        return ($r->{headers}{'x-s-action'} // '',
                $r->{json}{timings}{draft_n_accepted} // 0);
    };
    $ask->('a');
    my ($act, $n) = $ask->('a');
    $accepted{slot} = $n if $tier eq 'ram';
    $ask->('b');
    ($act, $n) = $ask->('a');
    is($act, $tier eq 'ram' ? 'ram' : 'restore', "$tier: a came back by $act");
    $accepted{$tier} = $n;
    $t->stop;
}
cmp_ok($accepted{slot}, '>', 0,
       "draft tokens accepted on a turn kept in its slot: $accepted{slot}");
cmp_ok($accepted{ram}, '>', 0,
       "after a swap through RAM: $accepted{ram}; after a restore from a "
       . "file: $accepted{files}");

done_testing;
