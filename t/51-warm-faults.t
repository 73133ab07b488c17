#!/usr/bin/perl

# Warm starts against the fake backend, for what the real one does not
# show on demand: the prime's exact body (the system prompt, tools and
# template arguments as sent, nothing of the conversation), a template
# that refuses a system prompt alone, a base file gone behind nginx's
# back, and the order of slot calls that keeps tenants apart.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $JSON = $LlamaTest::JSON;

my $t = LlamaTest->new(workers => 2);
$t->fake;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    upstream => '',
    server => q{
        llama_session_namespace $http_x_tenant;
        llama_session_warm system min=64;
        add_header X-S-Action $llama_session_action always;
    }));

my $system = 'You are a careful assistant. ' x 8;
my $tools = [ { type => 'function',
                function => { name => 'lookup', parameters => {} } } ];

sub ask {
    my ($sid, $text, %o) = @_;
    my $body = { messages => [ { role => 'system', content => $o{system}
                                                             // $system },
                               { role => 'user', content => $text } ],
                 $o{bare} ? () : (
                     tools => $tools,
                     chat_template_kwargs =>
                         { enable_thinking => JSON::PP::false }) };
    my $r = $t->post('/v1/chat/completions', $body,
                     headers => { 'X-Session-Id' => $sid,
                                  %{ $o{headers} // {} } });
    $r->{action} = $r->{headers}{'x-s-action'};
    $r->{cache_n} = $r->{json}{timings}{cache_n};
    return $r;
}

sub calls_since {
    my ($n) = @_;
    my @c = @{ $t->fake_calls };
    return @c[$n .. $#c];
}

sub what {
    my ($c) = @_;
    return $c->{path} =~ m{^/slots/\d+$} ? ($c->{query} =~ /action=(\w+)/)[0]
         : $c->{path} eq '/slots' ? 'get'
         : $c->{path} eq '/apply-template' ? 'template'
         : $c->{path} eq '/tokenize' ? 'tokens'
         : LlamaTest::prefix_call($c) ? 'reprime'
         : $c->{method} eq 'POST' ? (($c->{body} // '') =~ /"max_tokens":1,/
                                     ? 'prime' : 'completion')
         : 'other';
}

# the first conversation makes the base: erase, prime, save, then itself
my $r = ask('alpha', 'secret alpha words');
is($r->{status}, 200, 'alpha is served');
is($r->{action}, 'fresh', 'alpha starts fresh');
my @calls = map { what($_) } grep { what($_) ne 'other' && what($_) ne 'get' }
            @{ $t->fake_calls };
is_deeply(\@calls, [ qw(erase prime save completion) ],
          'an erase (a slot GET /slots shows without n_prompt_tokens may '
          . 'hold a restored state), the prime, the base\'s save, then '
          . 'alpha\'s request');
my ($prime) = grep { what($_) eq 'prime' } @{ $t->fake_calls };
my $pb = $JSON->decode($prime->{body});
is_deeply($pb->{messages}, [ { role => 'system', content => $system } ],
          'the prime holds the system prompt alone, as sent');
is_deeply($pb->{tools}, $tools, 'and the tools');
is_deeply($pb->{chat_template_kwargs}, { enable_thinking => JSON::PP::false },
          'and the template arguments');
is($pb->{max_tokens}, 1, 'with one token to generate');
is($prime->{path}, '/v1/chat/completions', 'on the chat endpoint');
my @bases = glob($t->dir . '/slots/base-*.bin');
is(scalar @bases, 1, 'the base is saved');
unlike($t->read_file($bases[0]), qr/secret alpha/,
       'and holds nothing of alpha\'s conversation');

# the next one cuts the slot back to the system prompt: no erase
my $n = @{ $t->fake_calls };
$r = ask('beta', 'beta words');
is($r->{action}, 'warm', 'beta starts warm');
@calls = map { what($_) } calls_since($n);
ok(!(grep { $_ eq 'erase' || $_ eq 'restore' } @calls),
   'from the slot, cut back by a prime: no erase, no restore')
    or diag "@calls";
my $sys_len = length $JSON->encode([ { role => 'system', content => $system } ]);
is($r->{cache_n}, $sys_len - 1, 'beta finds the system prompt, no more');

# without an id: the system prompt's hash and the first message name the
# session, and it starts warm all the same; so does "default"
$r = $t->post('/v1/chat/completions',
              { messages => [ { role => 'system', content => $system },
                              { role => 'user', content => 'no id here' } ],
                tools => $tools,
                chat_template_kwargs => { enable_thinking => JSON::PP::false } });
is($r->{headers}{'x-s-action'}, 'warm', 'a session without an id (sys-) '
   . 'starts warm');
is($r->{json}{timings}{cache_n}, $sys_len - 1, 'with the system prompt '
   . 'cached');
$r = $t->post('/v1/chat/completions',
              { messages => [ { role => 'system', content => $system },
                              { role => 'user', content => 'a probe' } ],
                tools => $tools, max_tokens => 1,
                chat_template_kwargs => { enable_thinking => JSON::PP::false } },
              headers => { 'X-Session-Id' => 'beta' });
is($r->{headers}{'x-s-action'}, 'warm', 'a probe, run as "default", starts '
   . 'warm too');

# another tenant: never from this tenant's slot
$n = @{ $t->fake_calls };
$r = ask('gamma', 'gamma words', headers => { 'X-Tenant' => 'other' });
is($r->{action}, 'fresh', 'another tenant\'s conversation starts fresh');
@calls = grep { $_ ne 'get' && $_ ne 'other' } map { what($_) } calls_since($n);
is_deeply(\@calls, [ qw(erase prime save completion) ],
          'the slot (the probe\'s "default") erased before the tenant\'s '
          . 'prime')
    or diag "@calls";

# a template that refuses a system prompt alone
$n = @{ $t->fake_calls };
$t->fake_script({ completion => { status => 400, match => '"max_tokens":1,' } });
$r = ask('delta', 'delta words', headers => { 'X-Tenant' => 'other' });
$t->fake_script({});
is($r->{status}, 200, 'a refused prime: the request is served');
is($r->{action}, 'fresh', 'fresh');
is($r->{cache_n}, 0, 'from an empty slot: nothing of gamma is reused');
@calls = grep { $_ ne 'get' && $_ ne 'other' } map { what($_) } calls_since($n);
is_deeply(\@calls, [ qw(template tokens template tokens reprime save prime
                         erase completion) ],
          'gamma, re-primed and saved, leaves the slot, which is erased '
          . 'after the refused prime')
    or diag "@calls";
ok($t->log_lines(qr/\[warn\].*llama-server refused the system prompt alone for base "base-[0-9a-f]{24}" \(400/),
   'the refusal is logged');

# the base gone behind nginx's back: made again
unlink @bases or die;
$n = @{ $t->fake_calls };
$r = ask('eps', 'eps words', system => 'Another system prompt. ' x 8);
$r = ask('zeta', 'zeta words');
is($r->{status}, 200, 'zeta is served though its base is gone');
is($r->{action}, 'fresh', 'fresh');
ok($t->log_lines(qr/restoring base "base-[0-9a-f]{24}" into slot 0 failed \(400: .*\), it is made anew/),
   'the failed restore is logged');
ok(-e $bases[0], 'the base is saved again');
$r = ask('eta', 'eta words', system => 'Another system prompt. ' x 8);
$r = ask('theta', 'theta words');
is($r->{action}, 'warm', 'the next conversation starts warm from it');
is($r->{cache_n}, $sys_len - 1, 'with the system prompt cached');

# Anthropic's request: its base primed as the chat completion the request
# becomes (anthropic.c), the system blocks one system message, pinned
$n = @{ $t->fake_calls };
$r = $t->post('/v1/messages',
              { model => 'm', max_tokens => 8,
                system => [ { type => 'text', text => $system } ],
                messages => [ { role => 'user', content => 'hi' } ] },
              headers => { 'X-Session-Id' => 'anthropic' });
is($r->{status}, 200, 'an Anthropic request is served');
($prime) = grep { what($_) eq 'prime' } calls_since($n);
ok($prime, 'with a prime of its own');
is($prime && $prime->{path}, '/v1/chat/completions',
   'on /v1/chat/completions');
$pb = $prime ? $JSON->decode($prime->{body}) : {};
is_deeply($pb->{messages}, [ { role => 'system', content => $system } ],
          'Anthropic\'s system blocks as the system message, no other');
ok(defined $pb->{id_slot}, 'pinned');

# a short system prompt (under min=, tools count too): no prime, no base
$n = @{ $t->fake_calls };
$r = ask('short', 'short words', system => 'Be brief.', bare => 1);
is($r->{action}, 'fresh', 'a system prompt under min= starts fresh');
ok(!(grep { what($_) eq 'prime' } calls_since($n)), 'without a prime');

$t->stop;
done_testing;
