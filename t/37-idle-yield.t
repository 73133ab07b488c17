#!/usr/bin/perl

# An idle save never makes its own session's client wait (idle.c,
# reprime.c): a request of the session that comes while the idle save of
# its slot is under way, before the save's call to llama-server, takes the
# slot first (a hit); the save gives way, logged, and is made once the slot
# is idle again.  On the fake backend, whose GET /slots is made slow so the
# request comes while the idle save looks at the slot; the order of the
# calls llama-server got is what is checked, not a time.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
$t->fake;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% '
          . 'save_idle=500ms;',
    location => 'add_header X-S-Action $llama_session_action always;',
    slots => 'proxy_read_timeout 30s;'));

my @msgs = ({ role => 'user', content => 'Hello, I am Ann.' });

sub turn {
    my $r = $t->post('/v1/chat/completions', { messages => [ @msgs ] },
                     headers => { 'X-Session-Id' => 'ann' });
    is($r->{status}, 200, 'ann: 200');
    push @msgs, { role => 'assistant', content => 'ok' },
                { role => 'user', content => 'And then?' };
    return $r;
}

my $gets = sub {
    scalar grep { $_->{method} eq 'GET' && $_->{path} =~ m{^/slots} }
           @{ $t->fake_calls } };

turn();

# the idle save's look at the slot takes 2 s, its save 3 s
my $before = $gets->();
$t->fake_script({ slots => { delay_ms => 2000 },
                  save => { delay_ms => 3000 } });
ok($t->wait_for(sub { $gets->() > $before }, 10),
   'the idle save of ann begins (its GET /slots)');

my $r = turn();
is($r->{headers}{'x-s-action'}, 'hit', 'ann returns: a hit on her slot');

my @calls = @{ $t->fake_calls };
my ($chat) = grep { $calls[$_]{path} eq '/v1/chat/completions' } reverse 0 .. $#calls;
my ($save) = grep { ($calls[$_]{query} // '') eq 'action=save' } 0 .. $#calls;
ok(!defined $save || $save > $chat,
   'her request reached llama-server before any save of her slot');
ok($t->wait_for(sub { $t->log_lines(qr/"ann-\w+" on slot 0 of zone "llama" is not saved while idle: a request of the session came first/) }, 5),
   'the idle save gave way, logged');

# the slot changed again: saved once idle, as always
$t->fake_script({});
ok($t->wait_for(sub { $t->log_lines(qr/idle save of "ann-\w+" from slot 0/) }, 10),
   'ann is saved once idle again');
ok(!$t->log_lines(qr/\[(?:error|crit|alert)\]/), 'no error');

$t->stop;
done_testing;
