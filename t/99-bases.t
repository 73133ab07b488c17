#!/usr/bin/perl

# Bases nobody reused (llama_session_warm): each new conversation with a
# system prompt of its own leaves one (opencode's title request, a
# one-off script's), and they filled the store.  Eviction now takes the
# bases no session ever started from before anything else, and counts
# their files and bytes (metrics, API); a base's uses survive a restart
# (its .json).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $JSON = $LlamaTest::JSON;
my %system = (s1 => 'You are the coding agent. ' x 10,
              s2 => 'You write a title for the conversation. ' x 10,
              s3 => 'Summarize.');

my $t = LlamaTest->new(workers => 2);
$t->fake;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% max_files=4;',
    server => 'llama_session_warm system min=64;',
    location => 'add_header X-S-Action $llama_session_action always;',
    extra => 'location /api/ { llama_session_api llama; }
              location = /metrics { llama_session_metrics; }'));

sub ask {
    my ($sid, $sys) = @_;
    my $r = $t->post('/v1/chat/completions',
                     { messages => [ { role => 'system',
                                       content => $system{$sys} },
                                     { role => 'user', content => "I am $sid" } ] },
                     headers => { 'X-Session-Id' => $sid });
    die "$sid: $r->{status}\n" unless $r->{status} == 200;
    return $r->{headers}{'x-s-action'};
}

sub base_of {
    my ($sys) = @_;
    # the base primed for the conversation that says so in its swap line
    my ($key) = map { /in "\Q$_[1]\E[^"]*" fresh, base "(base-\w+)"/ ? $1 : () }
                $t->log_lines(qr/primed/);
    return $key;
}

sub files { map { m{/([^/]+)\.[0-9a-f]{8}\.bin$} ? $1 : () }
            glob($t->{slots} . '/*.bin') }

sub metric {
    my ($name) = @_;
    my $text = $t->get('/metrics')->{content} // '';
    return $text =~ /^nginx_llama_session_\Q$name\E\{[^}]*\} (\d+)/m ? $1 : undef;
}

is(ask('agent-a', 's1'), 'fresh', 'the agent\'s first conversation: fresh');
my $b1 = base_of('s1', 'agent-a');
ok($b1, "its base $b1 is saved");
is(ask('title-1', 's2'), 'fresh', 'a title request of its own: fresh');
my $b2 = base_of('s2', 'title-1');
ok($b2, "its base $b2 is saved too");
is(ask('agent-b', 's1'), 'warm', 'a second conversation of the agent: warm');
my ($sessions) = $t->get('/api/sessions')->{json};
my ($rec) = grep { $_->{key} eq $b1 } @{ $sessions->{sessions} };
is($rec && $rec->{base_uses}, 1, 'the agent\'s base: used once (API)');
($rec) = grep { $_->{key} eq $b2 } @{ $sessions->{sessions} };
is($rec && $rec->{base_uses}, 0, 'the title\'s: never');
is(metric('store_base_files'), 2, 'two bases (metrics)');

# a fifth file (the agent's second conversation saved as another one
# takes the slot): the base nobody used goes, not the oldest session
is(ask('summary-1', 's3'), 'fresh', 'a request with a short system prompt');
my %have = map { $_ => 1 } files();
ok(!$have{$b2}, 'the unused title base was evicted');
ok($have{$b1}, 'the used base stays');
ok($have{ (grep { /^agent-a-/ } keys %have)[0] // 'none' },
   'and so does the oldest conversation');
ok($t->log_lines(qr/evicted session "\Q$b2\E/), 'the eviction is logged');
my $bytes = 0;
$bytes += -s $_ for grep { m{/base-} } glob($t->{slots} . '/*.bin');
is(metric('store_base_bytes'), $bytes, "the bases' bytes: $bytes");
is($t->get('/api/sessions')->{json}{base_bytes}, $bytes, 'in the API too');

# a base's uses are in its .json: they count after a restart
my ($meta) = glob($t->{slots} . "/$b1.*.json");
my $m = $JSON->decode($t->read_file($meta));
ok($m->{base} && $m->{base_uses} == 1, 'the base\'s .json says it was used');
$t->stop_nginx;
$t->start_nginx;
($rec) = grep { $_->{key} eq $b1 } @{ $t->get('/api/sessions')->{json}{sessions} };
is($rec && $rec->{base_uses}, 1, 'after a restart too');
is(metric('store_base_files'), 1, 'and the base is counted again');
$t->stop;

done_testing;
