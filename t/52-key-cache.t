#!/usr/bin/perl

# Each worker keeps the last session key it derived, to skip SHA-256 when
# the same session comes again; what it keeps with the key (the id's
# digest the API finds sessions by, the system prompt's base) must be the
# session's too.  One worker, so the second request finds the first's
# key; the API clears the slot in between, so the second one swaps and
# records the session again from the worker's cache.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 1);
$t->fake;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    server => q{
        llama_session_warm system min=16;
        add_header X-S-Action $llama_session_action always;
    },
    extra => 'location /api/ { llama_session_api llama; }'));

my $system = 'You answer in one line. ' x 4;

sub ask {
    my ($sid) = @_;
    return $t->post('/v1/chat/completions',
                    { messages => [ { role => 'system', content => $system },
                                    { role => 'user', content => "hi $sid" } ] },
                    headers => { 'X-Session-Id' => $sid });
}

is(ask('x')->{status}, 200, 'x is served');
is($t->post('/api/sessions/save', {})->{status}, 200, 'x is saved');
is($t->post('/api/sessions/clear', {})->{status}, 200, 'the slot is cleared');
my $r = ask('x');
is($r->{headers}{'x-s-action'}, 'restore', 'x again: restored, its key '
   . 'from the worker\'s cache');

is($t->get('/api/sessions/x')->{status}, 200,
   'the API finds x by its id after that');

$r = ask('z');
is($r->{headers}{'x-s-action'}, 'warm', 'z, the same system prompt, starts '
   . 'warm');
ok($t->log_lines(qr/in "z-\w+" warm from the slot's system prompt/),
   'from the slot x left, which is known to start with that prompt');

$t->stop;
done_testing;
