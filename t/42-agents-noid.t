#!/usr/bin/perl

# Two coding agents that send no conversation id, replayed from their own
# recorded requests against a real llama-server with one slot (every return
# is a swap).  t/data/qwen-code-exchange.jsonl: Qwen Code 0.24.4, `qwen -p`
# in one folder, two conversations and the first one's second turn
# (`--resume`), each turn followed by its memory-extraction side request
# (a system prompt of its own).  Every first user message is the same but
# for its last part, and on the resumed turn the date reminder has moved
# from the first user message to the last: the request extends none of the
# first one's, and echoes the reply it was given.  t/data/pi-exchange.jsonl:
# pi 0.73.1, `pi -p`, two conversations and the first one's second turn,
# which extends its first.  Recorded with t/record-chat.mjs; a real client
# echoes the reply it got, so a replayed turn echoes llama-server's reply,
# not the recorder's.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $JSON = $LlamaTest::JSON;

sub recorded {
    my ($name) = @_;
    open my $fh, '<', "$FindBin::Bin/data/$name" or die "$name: $!";
    return grep { $_->{method} eq 'POST' }
           map { $JSON->decode($_) } grep { /\S/ } <$fh>;
}

my $t = LlamaTest->new(workers => 2);
$t->llama(np => 1, ctx => 65536, args => [ '-b', 4096, '-ub', 1024 ]);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m slots=1 store=%%SLOTS%%;',
    server => 'llama_session_warm system;
               client_max_body_size 16m;',
    location => 'proxy_read_timeout 600s;
                 add_header X-S-Id $llama_session_id always;
                 add_header X-S-Key $llama_session_key always;
                 add_header X-S-Action $llama_session_action always;',
    slots => 'proxy_read_timeout 600s;'));

# a recorded request as the agent sent it, answered by llama-server
sub replay {
    my ($req, %o) = @_;
    my %h = %{ $req->{headers} };
    delete @h{qw(host content-length connection accept-encoding)};
    my $body = $JSON->decode($JSON->encode($req->{body}));
    delete @$body{qw(max_tokens max_completion_tokens)};
    $body->{max_tokens} = $o{max} // 6;
    $body->{temperature} = 0;
    if (defined $o{echo}) {
        # the reply the agent got, where the recorder's "Hi." stands
        my ($a) = grep { $_->{role} eq 'assistant' } @{ $body->{messages} };
        $a->{content} = $o{echo};
    }
    my ($status, $events, $raw, $res) =
        $t->stream('/v1/chat/completions', $body, headers => \%h);
    my ($usage) = map { $_->{usage} } grep { ref && $_->{usage} } @$events;
    my $text = join '', map { $_->{choices}[0]{delta}{content} // '' }
                        grep { ref && $_->{choices} } @$events;
    return { status => $status, raw => $raw, text => $text,
             key => $res->{headers}{'x-s-key'} // '',
             id => $res->{headers}{'x-s-id'} // '',
             action => $res->{headers}{'x-s-action'} // '',
             prompt => $usage->{prompt_tokens} // 0,
             cached => $usage->{prompt_tokens_details}{cached_tokens} // 0 };
}

# --- Qwen Code -------------------------------------------------------------

my @q = recorded('qwen-code-exchange.jsonl');
is(scalar @q, 6, 'Qwen Code: three turns, each with its side request');
ok(!(grep { my $h = $_->{headers};
            grep { /session|conversation|affinity/i } keys %$h } @q),
   'Qwen Code sends no id');

my $q1 = replay($q[0]);
is($q1->{status}, 200, 'Qwen Code, conversation 1: 200') or diag $q1->{raw};
cmp_ok($q1->{prompt}, '>', 5000, "its prompt: $q1->{prompt} tokens");
my $s1 = replay($q[1]);
# (the random model says the same words to every prompt: their number
# tells the two conversations' replies apart, as a real model's words do)
my $q2 = replay($q[2], max => 5);
is($q2->{status}, 200, 'conversation 2: 200');
isnt($q2->{key}, $q1->{key}, 'conversation 2 is a session of its own');
is($q2->{action}, 'warm', "it starts warm ($q2->{cached} of $q2->{prompt} "
                          . 'tokens cached)');
isnt($s1->{key}, $q1->{key}, 'the memory extraction has a key of its own');
my $s2 = replay($q[3]);

isnt($q2->{text}, $q1->{text}, 'the two conversations got replies of '
                                 . 'their own');
my $q3 = replay($q[4], echo => $q1->{text});
is($q3->{key}, $q1->{key},
   'the resumed turn of conversation 1 (its first message rewritten) is '
   . 'conversation 1');
cmp_ok($q3->{cached}, '>=', 0.9 * $q1->{prompt},
       "it comes back with its cache: $q3->{cached} of its previous "
       . "$q1->{prompt} tokens ($q3->{action})");

# the conversations go on as Qwen Code goes on: each turn moves the date
# reminder from the previous last user message to its own, and pastes a
# long text
sub paste {
    my ($who) = @_;
    return { type => 'text', text => join ' ', map { "$who line $_: a file "
                                                     . 'pasted for review.' }
                                               1 .. 300 };
}

sub next_turn {
    my ($prev, $reply, $text) = @_;
    my $body = $JSON->decode($JSON->encode($prev->{body}));
    my $last = $body->{messages}[-1]{content};
    my @reminder = grep { ($_->{text} // '') =~ /The current date is/ } @$last;
    $body->{messages}[-1]{content} =
        [ grep { ($_->{text} // '') !~ /The current date is/ } @$last ];
    push @{ $body->{messages} },
        { role => 'assistant', content => $reply },
        { role => 'user', content => [ @reminder, @$text ] };
    return { %$prev, body => $body };
}

# conversation 1's resumed turn pastes a file; conversation 2's next turn
# another; then conversation 1 goes on
my $c1t2 = { %{ $q[4] } };
$c1t2->{body} = $JSON->decode($JSON->encode($q[4]{body}));
$c1t2->{body}{messages}[2]{content} = $q1->{text};
push @{ $c1t2->{body}{messages}[-1]{content} }, paste('c1');
my $r12 = replay($c1t2);
is($r12->{key}, $q1->{key}, 'conversation 1 pastes a file');

my $c2t2 = next_turn($q[2], $q2->{text}, [ paste('c2') ]);
my $r22 = replay($c2t2, max => 5);
is($r22->{key}, $q2->{key}, 'conversation 2 pastes another: its own key');
cmp_ok($r22->{cached}, '>=', 0.9 * $q2->{prompt},
       "its own cache: $r22->{cached} of $q2->{prompt} ($r22->{action})");

my $c1t3 = next_turn($c1t2, $r12->{text},
                     [ { type => 'text', text => 'and the tests?' } ]);
my $r13 = replay($c1t3);
is($r13->{key}, $q1->{key}, 'conversation 1 goes on: its own key');
# Qwen Code rewrites the previous last user message (the reminder goes):
# what comes from it on is computed again, through the module as without;
# all before it is conversation 1's own, its reply included, which
# conversation 2's state does not have
cmp_ok($r13->{cached}, '>=', $q3->{cached} + 20,
       "with its own history cached up to its rewritten message: "
       . "$r13->{cached} of $r13->{prompt} tokens ($r13->{action}; "
       . "$q3->{cached} are what its first message shares with the "
       . "other's)");

# --- pi --------------------------------------------------------------------

my @p = recorded('pi-exchange.jsonl');
is(scalar @p, 3, 'pi: three turns');

my $p1 = replay($p[0]);
is($p1->{status}, 200, 'pi, conversation 1: 200') or diag $p1->{raw};
my $p2 = replay($p[1], max => 5);
isnt($p2->{key}, $p1->{key}, 'pi\'s conversation 2: a session of its own');
my $p3 = replay($p[2], echo => $p1->{text});
is($p3->{key}, $p1->{key}, 'pi\'s second turn: conversation 1');
cmp_ok($p3->{cached}, '>=', 0.9 * $p1->{prompt},
       "with its cache: $p3->{cached} of $p1->{prompt} tokens "
       . "($p3->{action})");

$t->stop;
done_testing;
