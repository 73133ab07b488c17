#!/usr/bin/perl

# The isolation review: a warm start never crosses tenants, the empty
# namespace included.  A first conversation of tenant t2 with the system
# prompt of the default tenant's conversations starts from an erased slot:
# its base is primed by the module with nothing from the slot's cache (the
# reply then shows the tokens of t2's own prime as cached), and t2's next
# conversations start warm from t2's own base, from the slot or its file.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
$t->llama;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    server => 'llama_session_namespace $http_x_tenant;',
    location => q{
        proxy_read_timeout 300s;
        add_header X-S-Action $llama_session_action always;
    },
    slots => 'proxy_read_timeout 300s;'));

my $system = join ' ', map { "Rule $_: answer briefly and politely." } 1 .. 200;

sub chat {
    my ($sid, $tenant, $u) = @_;
    my $r = $t->post('/v1/chat/completions',
                     { messages => [ { role => 'system', content => $system },
                                     { role => 'user', content => $u } ],
                       max_tokens => 4, temperature => 0 },
                     headers => { 'X-Session-Id' => $sid,
                                  $tenant ? ('X-Tenant' => $tenant) : () });
    die "$sid: $r->{status}\n" unless $r->{status} == 200;
    return { action => $r->{headers}{'x-s-action'},
             cached => $r->{json}{timings}{cache_n},
             prompt => $r->{json}{usage}{prompt_tokens} };
}

sub swap_of {
    my ($sid) = @_;
    my @l = $t->log_lines(qr/swap on slot 0 .* in "\Q$sid\E-\w+"/);
    return $l[-1] // '';
}

is(chat('d1', '', 'Hello one.')->{action}, 'fresh', 'the default tenant: d1');
is(chat('d2', '', 'Hello two.')->{action}, 'warm', 'd2 warm from d1\'s prompt');
my ($dbase) = swap_of('d2') =~ /base "(base-\w+)"/;

my $x1 = chat('x1', 't2', 'Hello three.');
is($x1->{action}, 'fresh', 'tenant t2\'s first conversation starts fresh');
like(swap_of('x1'), qr/out "d2-\w+" saved .* in "x1-\w+" fresh, base "base-\w+" primed \(0 tokens from the slot's cache\)/,
     'its base is primed from an erased slot: nothing of d2\'s state');
my ($xbase) = swap_of('x1') =~ /base "(base-\w+)"/;
isnt($xbase, $dbase, 'a base of its own');

my $x2 = chat('x2', 't2', 'Hello four.');
is($x2->{action}, 'warm', 'its next conversation starts warm');
like(swap_of('x2'), qr/warm from the slot's system prompt \(base "\Q$xbase\E"\)/,
     'from t2\'s own base');
ok($x2->{cached} >= $x2->{prompt} - 40, "with the system prompt cached ($x2->{cached})");

my $d3 = chat('d3', '', 'Hello five.');
is($d3->{action}, 'warm', 'the default tenant again');
like(swap_of('d3'), qr/warm from base "\Q$dbase\E"/,
     'from its own base\'s file, not from t2\'s slot');
my $x3 = chat('x3', 't2', 'Hello six.');
like(swap_of('x3'), qr/warm from base "\Q$xbase\E"/,
     'and t2 from its own file, not from the default tenant\'s slot');

$t->stop;
done_testing;
