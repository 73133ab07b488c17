#!/usr/bin/perl

# llama-server's router mode (no -m, many models) needs a zone per model
# (model=, t/73-router-real.t): a zone without model= in front of a router
# says so in the error log and answers 502 JSON, instead of taking one
# model's slots for another's.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
$t->fake(script => { router => 1 });
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;'));

my $r = $t->post('/v1/chat/completions',
                 { model => 'any', messages => [ { role => 'user',
                                                   content => 'hi' } ] },
                 headers => { 'X-Session-Id' => 'r1' });
is($r->{status}, 502, 'a request through a zone that faces a router: 502');
is($r->{json}{error}{type}, 'server_error', 'with a JSON error');
like($r->{json}{error}{message}, qr/router mode, which nginx's llama_session zone is not set for: it needs "models="/,
     'which names the fix (before: "did not answer a slot call (GET /props)")');
ok($t->log_lines(qr/zone "llama" faces llama-server's router mode: give each of the router's models a zone with "model=", or give the zone "models="/),
   'the error log says why');
ok(!(grep { $_->{method} eq 'POST' } @{ $t->fake_calls }),
   'nothing ran on the backend');

$t->stop;

# a reload that gives a zone another model= is refused, as one of slots=:
# its slots' contents and fingerprint are the old model's

$t = LlamaTest->new(workers => 2);
$t->fake(script => { router => 1 });
$t->nginx($t->site(
    zone => 'llama_session_zone zone=small:1m model=small store=%%SLOTS%%;'));

my $conf = $t->read_file('nginx.conf');
$conf =~ s/model=small/model=big/ or die;
open my $fh, '>', $t->dir . '/nginx.conf' or die;
print $fh $conf;
close $fh;
$t->allow_alerts(qr/drives model "big" while previously it drove "small"/);
kill 'HUP', $t->{pids}{nginx};
ok($t->wait_for(sub { $t->log_lines(
    qr/\[emerg\].*llama_session zone "small" drives model "big" while previously it drove "small": restart nginx/) }, 10),
   'a reload that changes a zone\'s model= is refused, with both models');

$t->stop;
done_testing;
