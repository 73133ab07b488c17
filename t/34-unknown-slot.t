#!/usr/bin/perl

# The isolation review: a slot that llama-server shows without
# n_prompt_tokens (restored after a restart, and no task ran on it since:
# here llama-server refused the request with 400 before its task started)
# holds what the module cannot vouch for; it is erased before another
# session (here another tenant's, sending the same prompt) runs there.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2, timeout => 300);
my $port = $t->llama(np => 1, ctx => 8192);

$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    server => 'llama_session_namespace $http_x_tenant;',
    location => q{
        proxy_read_timeout 300s;
        add_header X-S-Action $llama_session_action always;
    },
    slots => 'proxy_read_timeout 300s;'));

my $secret = join ' ', map { "Tenant a's private note $_." } 1 .. 60;

sub turn {
    my ($tenant, $sid, $text, %extra) = @_;
    return $t->post('/v1/chat/completions',
                    { messages => [ { role => 'user', content => $text } ],
                      max_tokens => 2, temperature => 0, %extra },
                    headers => { 'X-Tenant' => $tenant, 'X-Session-Id' => $sid });
}

my $a1 = turn('a', 's1', $secret);
is($a1->{status}, 200, 'tenant a, s1');
is(turn('a', 's2', 'something else entirely')->{status}, 200,
   'tenant a, s2: s1 is saved');

$t->stop_llama;
$t->llama(np => 1, ctx => 8192, port => $port);

my $a2 = turn('a', 's1', $secret, n_predict => -5);
is($a2->{headers}{'x-s-action'}, 'restore', 'after the restart s1 is restored');
is($a2->{status}, 400, 'and llama-server refuses the request before its task');
my $slots = $LlamaTest::JSON->decode(
    $t->{http}->get("http://127.0.0.1:$port/slots")->{content});
ok(!exists $slots->[0]{n_prompt_tokens},
   'GET /slots shows no n_prompt_tokens for the restored slot');

my $b1 = turn('b', 's9', $secret);
is($b1->{status}, 200, 'tenant b sends the same prompt');
ok(($b1->{json}{timings}{cache_n} // 1e9) < 64,
   'and gets nothing of tenant a\'s restored state: '
   . ($b1->{json}{timings}{cache_n} // 'none') . ' tokens cached');
ok($t->log_lines(qr/in "s9-\w+" (fresh|warm)/), 'its swap erased the slot first')
    or diag join "\n", $t->log_lines(qr/swap on slot/);

$t->stop;
done_testing;
