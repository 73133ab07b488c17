#!/usr/bin/perl

# Conversations that carry no id, against a real llama-server with two
# slots: a request belongs to the conversation whose requests it extends.
# Qwen Code's shape: no id anywhere, every conversation opens with the same
# injected exchange (a user message with the date and the folder, an
# assistant's "Got it."), so the system prompt and the first message are
# the same for all of them.  Three such conversations take turns on two
# slots: each comes back with its own history cached (restored from its own
# file), its own key; the first keeps the key it always had (sys-…).  Also:
# a conversation whose first message differs (pi's shape) keeps sys-…; a
# regenerated turn and an edited last message stay in their conversation;
# a client that trims its history starts a conversation of its own; a
# probe with the shared opening learns nothing beyond the system prompt;
# two new conversations at once run on two slots; after a restart of nginx
# the zone learns the conversations again from their files.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
$t->llama(np => 2, ctx => 32768);

my $site = $t->site(
    zone => 'llama_session_zone zone=llama:1m slots=2 store=%%SLOTS%%;',
    upstream => 'keepalive 4;',
    location => q{
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_read_timeout 300s;
        add_header X-S-Id $llama_session_id always;
        add_header X-S-Key $llama_session_key always;
        add_header X-S-Action $llama_session_action always;
        add_header X-S-Slot $llama_session_slot always;
    },
    extra => 'location = /metrics { llama_session_metrics llama; }');
$t->nginx($site);

my $system = join ' ', map { "Rule $_: you are Qwen Code, an interactive "
                             . "CLI agent; follow section $_." } 1 .. 60;
my @opening = (
    { role => 'user',
      content => "This is the Qwen Code. We are setting up the context for "
               . "our chat.\nToday's date is Wednesday, December 2, 2026.\n"
               . "My operating system is: linux\nI'm currently working in "
               . "the directory: /home/dev/project" },
    { role => 'assistant', content => 'Got it. Thanks for the context!' },
);

sub conversation {
    my ($name, @lead) = @_;
    return { name => $name, n => 0,
             messages => [ { role => 'system', content => $system }, @lead ] };
}

# one turn: the reply's figures and the module's headers
sub turn {
    my ($c, $text) = @_;

    $c->{n}++;
    $text //= $c->{n} == 1
        ? join(' ', map { "$c->{name} task detail $_: files, tests and "
                          . "a plan." } 1 .. 30)
        : "$c->{name}: next step $c->{n}?";
    push @{ $c->{messages} }, { role => 'user', content => $text };

    return ask($c);
}

sub ask {
    my ($c) = @_;
    my $r = $t->post('/v1/chat/completions',
                     { model => 'qwen3-coder', messages => $c->{messages},
                       max_tokens => $c->{max} // 4, temperature => 0,
                       seed => 1 });
    die "turn of $c->{name}: $r->{status} $r->{content}\n"
        unless $r->{status} == 200;

    push @{ $c->{messages} },
        { role => 'assistant',
          content => $r->{json}{choices}[0]{message}{content} };

    my %out = (prompt => $r->{json}{usage}{prompt_tokens},
               cached => $r->{json}{usage}{prompt_tokens_details}
                         {cached_tokens} // 0,
               map { $_ => $r->{headers}{"x-s-$_"} }
                   qw(id key action slot));
    $c->{prev} = $c->{last};
    $c->{last} = \%out;
    return \%out;
}

# requests with no id and no system prompt (llama.cpp's own
# test_completion_parallel_slots): "default", run at once on two slots as
# llama-server alone runs them (on a fresh backend, as that test runs)
{
    my @prompts = ('Write a very long book.', 'Write another a poem.',
                   'What is LLM?', 'The sky is blue and I love it.');
    my @h = map {
        $t->async_post('/completion', { prompt => $_ x 40, n_predict => 48,
                                        seed => 42, temperature => 1.0 })
    } @prompts;
    my @r = map { $t->async_wait($_) } @h;
    is(scalar(grep { $_->{status} == 200 } @r), 4,
       'four requests without an id at once: all answered');
    is(scalar(grep { ($_->{headers}{'x-s-id'} // '') eq 'default' } @r), 4,
       'all of them "default"');
    my %slots = map { ($_->{headers}{'x-s-slot'} // '') => 1 } @r;
    is(scalar keys %slots, 2, 'on both slots');
    my ($a, $b) = grep { $_->{headers}{'x-s-slot'} ne $r[0]{headers}{'x-s-slot'} }
                  @r;
    ok($a && $r[0]{start} < $a->{end} && $a->{start} < $r[0]{end},
       'two of them at once');
}

# (replies of their own: the random model says the same words to every
# prompt, their number tells them apart)
my @q = map { { %{ conversation("Q$_", @opening) }, max => 3 + $_ } } 1 .. 3;

# first turns: one family, three conversations
my @first = map { turn($_) } @q;
# (the very first request after a start comes before the zone knows its
# backend's configuration, and cannot check the family's file: it takes an
# id of its own too)
my ($family) = $first[0]{id} =~ /^(sys-[0-9a-f]{16})/;
like($first[$_]{id}, qr/^\Q$family\E(-[0-9a-f]{16})?$/,
     "conversation " . ($_ + 1) . " of the family: sys-…") for 0 .. 2;
is(scalar(grep { $_->{id} eq $family } @first), 1,
   'one of them keeps the family\'s id');
my %keys = map { $_->{key} => 1 } @first;
is(scalar keys %keys, 3, 'three conversations, three keys');

# they take turns on two slots: every return finds its own history
for my $round (2 .. 4) {
    for my $c (@q) {
        my $prev = $c->{last}{prompt};
        my $r = turn($c);
        is($r->{key}, $first[$c->{name} =~ /(\d)/ && $1 - 1]{key},
           "$c->{name} turn $round: its own key");
        is($r->{id}, $first[$c->{name} =~ /(\d)/ && $1 - 1]{id},
           "$c->{name} turn $round: its own id");
        cmp_ok($r->{cached}, '>=', 0.9 * $prev,
               "$c->{name} turn $round: $r->{cached} of its previous "
               . "$prev tokens cached ($r->{action})");
    }
}

# what the zone keeps to know them by, in its metrics
my ($chains) = $t->get('/metrics')->{content}
               =~ /^nginx_llama_session_id_chains\{zone="llama"\} (\d+)$/m;
cmp_ok($chains // 0, '>=', 6,
       "nginx_llama_session_id_chains: $chains (requests and replies)");

my @bins = glob($t->dir . '/slots/*.bin');
my %on_disk = map { my ($k) = m{/([^/]+)\.[^.]+\.bin$}; ($k // '') => 1 }
              @bins;
is(scalar(grep { $on_disk{$_} } keys %keys), 3,
   'each conversation has its own file');

# a regenerated turn (the same request again) and an edited last message
{
    my $c = $q[0];
    pop @{ $c->{messages} };                       # the reply
    my $r = ask($c);
    is($r->{key}, $first[0]{key}, 'the same request again: its conversation');

    pop @{ $c->{messages} };
    pop @{ $c->{messages} };                       # the question
    push @{ $c->{messages} }, { role => 'user', content => 'Q1: edited?' };
    $r = ask($c);
    is($r->{key}, $first[0]{key}, 'an edited last message: its conversation');
    cmp_ok($r->{cached}, '>=', 0.8 * $c->{prev}{prompt},
           "and most of its history cached ($r->{cached})");
}

# Qwen Code's own shape (0.24.4, recorded in t/data): the opening and a
# date reminder are text parts of the first user message, and on the next
# turn the reminder moves to the last user message: the first message is
# rewritten, so the request extends no earlier one; it still echoes the
# reply it was given, and that reply names its conversation
{
    my $opening = join ' ', map { "Skill $_: how to use tool $_ well." }
                            1 .. 80;
    my $reminder = '<system-reminder>Today is Wednesday.</system-reminder>';
    my %c;
    for my $who (qw(R S)) {
        my $c = $c{$who} = conversation($who);
        push @{ $c->{messages} },
            { role => 'user', content => [
                { type => 'text', text => $opening },
                { type => 'text', text => $reminder },
                { type => 'text', text => "$who: what is in the folder?" } ] };
        my $r = $t->post('/v1/chat/completions',
                         { model => 'qwen3-coder', messages => $c->{messages},
                           max_tokens => $who eq 'R' ? 8 : 7,
                           temperature => 0 });
        die "$who: $r->{status} $r->{content}\n" unless $r->{status} == 200;
        $c->{reply} = $r->{json}{choices}[0]{message}{content};
        $c->{key} = $r->{headers}{'x-s-key'};
        $c->{prompt} = $r->{json}{usage}{prompt_tokens};
    }
    isnt($c{R}{key}, $c{S}{key}, 'two conversations that open alike');
    isnt($c{R}{reply}, $c{S}{reply}, 'with replies of their own');

    # R's next turn, as Qwen Code sends it: the reminder moved
    my $c = $c{R};
    $c->{messages}[1]{content} = [ @{ $c->{messages}[1]{content} }[0, 2] ];
    push @{ $c->{messages} },
        { role => 'assistant', content => $c->{reply} },
        { role => 'user', content => [
            { type => 'text', text => $reminder },
            { type => 'text', text => 'R: and the Makefile?' } ] };
    my $r = ask($c);
    is($r->{key}, $c{R}{key},
       'a rewritten first message: the reply it echoes names its '
       . 'conversation');
    cmp_ok($r->{cached}, '>=', 0.9 * $c{R}{prompt},
           "and its own cache: $r->{cached} of its previous "
           . "$c{R}{prompt} tokens ($r->{action})");
}

# a client that trims its history but echoes its last reply: its
# conversation; one that compacts it into a summary: a conversation of its
# own
{
    my $u = { %{ conversation('U', @opening) }, max => 9 };
    turn($u) for 1 .. 3;
    my $c = conversation('T', @opening);
    push @{ $c->{messages} },
        @{ $u->{messages} }[5 .. $#{ $u->{messages} }];
    push @{ $c->{messages} }, { role => 'user', content => 'U: go on.' };
    my $r = ask($c);
    is($r->{key}, $u->{last}{key},
       'a trimmed history that echoes its last reply: its conversation');

    # two conversations given the same reply: an echo of it names neither
    my %same = map { $_ => conversation($_, @opening) } qw(D E);
    my %was = map { $_ => turn($same{$_}, "$_: what now?")->{key} } qw(D E);
    is($same{D}{messages}[-1]{content}, $same{E}{messages}[-1]{content},
       'two conversations given the same reply');
    $c = $same{D};
    $c->{messages}[3]{content} = 'D: what now? (rewritten)';
    push @{ $c->{messages} }, { role => 'user', content => 'D: go on.' };
    $r = ask($c);
    ok($r->{key} ne $was{D} && $r->{key} ne $was{E},
       'an echo of a reply two were given names neither');

    $c = conversation('C', @opening);
    push @{ $c->{messages} },
        { role => 'user', content => 'Summary of our work so far: U '
                                     . 'read the files and planned.' },
        { role => 'user', content => 'U: go on.' };
    $r = ask($c);
    ok(!$keys{ $r->{key} }, 'a compacted history is a new conversation');
    like($r->{id}, qr/^\Q$family\E-/, 'of the same family');
}

# a probe with the shared opening and a question of its own
{
    my $c = conversation('P', @opening);
    my $r = turn($c, 'What did the others ask?');
    ok(!$keys{ $r->{key} }, 'a probe is a conversation of its own');
    cmp_ok($r->{cached}, '<', $first[0]{prompt} - 200,
           "it finds no other conversation's messages ($r->{cached} cached, "
           . "$r->{action})");
}

# pi's shape: the first message differs, the id is the family's as before
{
    my $c = conversation('pi');
    my $r1 = turn($c, 'pi: list the files');
    like($r1->{id}, qr/^sys-[0-9a-f]{16}$/, 'another opening: its own sys-');
    ok(!$keys{ $r1->{key} }, 'another family, another key');
    my $r2 = turn($c);
    is($r2->{key}, $r1->{key}, 'and its next turn its conversation');
}

# two new conversations at once: two sessions, two slots
{
    my @h = map {
        my $n = $_;
        my $c = conversation("N$n", @opening);
        push @{ $c->{messages} }, { role => 'user',
            content => join ' ', map { "N$n long task $_." } 1 .. 300 };
        $t->async_post('/v1/chat/completions',
                       { model => 'qwen3-coder', messages => $c->{messages},
                         max_tokens => 8, temperature => 0 });
    } 1, 2;
    my @r = map { $t->async_wait($_) } @h;
    is($r[0]{status}, 200, 'parallel 1 answered');
    is($r[1]{status}, 200, 'parallel 2 answered');
    isnt($r[0]{headers}{'x-s-key'}, $r[1]{headers}{'x-s-key'},
         'two conversations');
    isnt($r[0]{headers}{'x-s-slot'}, $r[1]{headers}{'x-s-slot'},
         'on two slots');
    ok($r[0]{start} < $r[1]{end} && $r[1]{start} < $r[0]{end},
       'at once');
}

# a long conversation forked after 130 messages (an edit far back in a
# chat frontend, an agent forking a long shared history): two
# conversations, each with its own key and its own cache, however many
# messages they share
my @fork;
{
    my @shared = map { ({ role => 'user', content => "long $_?" },
                        { role => 'assistant', content => "ok $_." }) }
                 1 .. 65;
    @fork = map { { %{ conversation("F$_", @opening, @shared) },
                    max => 4 + $_ } } 1, 2;
    my @r = map { turn($_, "$_->{name}: which branch is this?") } @fork;
    cmp_ok(scalar @{ $fork[0]{messages} }, '>', 130,
           'a conversation of more than 130 messages');
    isnt($r[0]{key}, $r[1]{key},
         'forked after 130 messages: two conversations');
    for my $round (2, 3) {
        for my $c (@fork) {
            my $prev = $c->{last}{prompt};
            my $key = $c->{last}{key};
            my $r = turn($c);
            is($r->{key}, $key, "$c->{name} turn $round: its own key");
            cmp_ok($r->{cached}, '>=', 0.9 * $prev,
                   "$c->{name} turn $round: $r->{cached} of its previous "
                   . "$prev tokens cached ($r->{action})");
        }
    }
}

# a client that names the module's id for a conversation (sys-…, known to
# whoever knows the system prompt) with the same first message does not get
# that conversation: the module's ids and the clients' are apart
{
    my $c = conversation('pi2');
    my $r1 = turn($c, 'pi2: list the files');
    my $r2 = turn($c);
    like($r1->{id}, qr/^sys-[0-9a-f]{16}$/, 'a conversation without an id');
    my $r = $t->post('/v1/chat/completions',
                     { model => 'qwen3-coder', max_tokens => 4,
                       temperature => 0,
                       messages => [ @{ $c->{messages} }[0 .. 2],
                                     { role => 'user',
                                       content => 'pi2: and the secrets?' } ]
                     },
                     headers => { 'X-Session-Id' => $r1->{id} });
    is($r->{status}, 200, 'a client that sends that id as its own: answered');
    is($r->{headers}{'x-s-id'}, $r1->{id}, 'under the id it gave');
    isnt($r->{headers}{'x-s-key'}, $r1->{key},
         'but not with the conversation\'s key');
    my $r3 = turn($c);
    is($r3->{key}, $r1->{key}, 'the conversation keeps its key');
    cmp_ok($r3->{cached}, '>=', 0.9 * $r2->{prompt},
           "and its cache ($r3->{cached} of $r2->{prompt})");
}

# nginx restarts: the zone learns the conversations from their files
{
    $t->stop_nginx;
    $t->start_nginx;

    for my $c (@q[1, 2], @fork) {
        my $prev = $c->{last}{prompt};
        my $r = turn($c);
        is($r->{key}, $c->{prev}{key},
           "$c->{name} after a restart: its own key");
        is($r->{id}, $c->{prev}{id},
           "$c->{name} after a restart: its own id");
        cmp_ok($r->{cached}, '>=', 0.9 * $prev,
               "$c->{name} after a restart: $r->{cached} of $prev cached "
               . "($r->{action})");
    }
}

$t->stop;
done_testing;
