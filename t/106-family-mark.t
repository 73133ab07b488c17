#!/usr/bin/perl

# Review 4, a suspicion settled: conversations without ids
# (llama_session_id_fallback system_hash, ext.c).  The first conversation
# of a family (same system prompt and first message) has the family's key
# ("sys-<16 hex>"), and a mark in the zone's table of chains says the key
# is taken.  The table keeps its most recently used entries, and the mark
# is made once: it ages out first while the conversation goes on.  Could a
# new conversation of the family then get the key of the live one (never
# saved, so no file to find either)?  No: the key is also taken while the
# zone's index has a record of its session, which a session in a slot
# has, with or without a file.  Fake backend, two slots, a zone small
# enough that thirty other conversations fill its table of chains (its
# mark is gone), the conversation never saved.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 1);
$t->fake(np => 2);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:128k slots=2 store=%%SLOTS%%;',
    extra => 'location = /metrics { llama_session_metrics llama; }',
    location => 'add_header X-S-Key $llama_session_key always;
                 add_header X-S-Id $llama_session_id always;'));

my $system = join ' ', map { "Family rule $_." } 1 .. 20;

sub turn {
    my ($c, $text) = @_;
    push @{ $c->{messages} }, { role => 'user', content => $text };
    my $r = $t->post('/v1/chat/completions',
                     { model => 'm', messages => $c->{messages},
                       max_tokens => 2 });
    die "$text: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    push @{ $c->{messages} },
        { role => 'assistant',
          content => $r->{json}{choices}[0]{message}{content} // 'ok' };
    return $r->{headers}{'x-s-key'};
}

# (the very first request after a start cannot look for a family's file
# yet: a request with an id first)
is($t->post('/completion', { prompt => 'warm up', n_predict => 1 },
            headers => { 'X-Session-Id' => 'warmup' })->{status}, 200,
   'the zone knows its backend');

my $f = { messages => [ { role => 'system', content => $system } ] };
my $key = turn($f, 'F: the first message of the family');
my $first = $key;
like($first, qr/^sys-[0-9a-f]{16}-[0-9a-f]{24}$/, "F has the family's key ($first)");
turn($f, 'F: turn 2');

# thirty other conversations, each of a family of its own, F between them
for my $i (1 .. 30) {
    my $o = { messages => [ { role => 'system',
                              content => "Other system prompt $i." } ] };
    turn($o, "O$i: hello");
    $key = turn($f, "F: turn " . ($i + 2));
    last if $key ne $first;
}
is($key, $first, 'F keeps its key through thirty other conversations');

ok(!glob("$t->{slots}/$first.*.bin"), 'F has no file');
my ($chains) = ($t->get('/metrics')->{content} // '')
               =~ /^nginx_llama_session_id_chains\{zone="llama"\} (\d+)$/m;
is($chains, 64, 'the table of chains is full (64 in a 128k zone)');

# G: F's family (the same system prompt and first message), its own later
# messages: a new conversation, never F's key
my $g = { messages => [ { role => 'system', content => $system },
                        { role => 'user',
                          content => 'F: the first message of the family' },
                        { role => 'assistant', content => 'something else' } ] };
my $gkey = turn($g, 'G: a question of its own');
isnt($gkey, $first, 'a new conversation of the family does not get the '
                    . 'key of the live one');
like($gkey, qr/^sys-[0-9a-f]{16}-[0-9a-f]+-[0-9a-f]{24}$/,
     "it gets a key of its own ($gkey)");
is(turn($f, "F: after G"), $first, "F goes on with its key");

$t->stop;

# Review 4, the other suspicion: one tenant that sends many new
# conversations without ids pushed every tenant's chains out of the one
# table (least recently used first): a quiet tenant's conversation was new
# again on its next turn (another key, its history prefilled anew).  Now a
# tenant that fills the table pushes out its own oldest first.
{
    my $t = LlamaTest->new(workers => 1);
    $t->fake(np => 2);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:128k slots=2 store=%%SLOTS%%;',
        location => 'llama_session_namespace $http_x_tenant;
                     add_header X-S-Key $llama_session_key always;'));
    my $ask = sub {
        my ($tenant, $c, $text) = @_;
        push @{ $c->{messages} }, { role => 'user', content => $text };
        my $r = $t->post('/v1/chat/completions',
                         { model => 'm', messages => $c->{messages},
                           max_tokens => 2 },
                         headers => { 'X-Tenant' => $tenant });
        die "$text: $r->{status} $r->{content}\n" unless $r->{status} == 200;
        push @{ $c->{messages} },
            { role => 'assistant',
              content => $r->{json}{choices}[0]{message}{content} // 'ok' };
        return $r->{headers}{'x-s-key'};
    };
    is($t->post('/completion', { prompt => 'warm up', n_predict => 1 },
                headers => { 'X-Session-Id' => 'warmup', 'X-Tenant' => 'q' })
       ->{status}, 200, 'tenants: the zone knows its backend');

    my $quiet = { messages => [ { role => 'system',
                                  content => 'The quiet tenant\'s assistant.' } ] };
    my $k = $ask->('quiet', $quiet, 'Q: first');
    is($ask->('quiet', $quiet, 'Q: second'), $k, 'the quiet tenant\'s conversation');

    # the other tenant: sixty new conversations, each of its own
    for my $i (1 .. 60) {
        my $c = { messages => [ { role => 'system',
                                  content => "Busy assistant $i." } ] };
        $ask->('busy', $c, "B$i: hello");
    }
    is($ask->('quiet', $quiet, 'Q: third'), $k,
       'after another tenant\'s sixty new conversations, the quiet tenant\'s '
       . 'next turn is still its conversation');
    $t->stop;
}

done_testing;
