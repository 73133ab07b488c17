#!/usr/bin/perl

# Which slot a session in no slot takes, with four slots (fake backend,
# -np 4): an empty one first, then the unsaved "default", then a saved and
# unchanged one (nothing to save), then the least recently used; a request
# without an id never takes a named session's slot while another choice
# exists.  Also the API's ?slot=K, and the pinning of every request.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $JSON = $LlamaTest::JSON;

my $t = LlamaTest->new(workers => 2);
$t->fake(np => 4);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m slots=4 store=%%SLOTS%%;',
    upstream => '',
    server => q{
        add_header X-S-Action $llama_session_action always;
        add_header X-S-Slot $llama_session_slot always;
        add_header X-S-Id $llama_session_id always;
    },
    extra => 'location /api/ { llama_session_api llama; }'));

sub ask {
    my ($sid, %o) = @_;
    my $r = $t->post('/v1/chat/completions',
                     { messages => [ { role => 'user',
                                       content => 'conversation '
                                                  . ($sid // 'none') } ],
                       %{ $o{extra} // {} } },
                     headers => { defined $sid ? ('X-Session-Id' => $sid)
                                               : () });
    $sid //= 'default';
    die "$r->{status} $r->{content}\n" unless $r->{status} == 200;
    return { slot => $r->{headers}{'x-s-slot'},
             action => $r->{headers}{'x-s-action'},
             id => $r->{headers}{'x-s-id'},
             cache_n => $r->{json}{timings}{cache_n} };
}

sub pinned {
    my @c = grep { $_->{method} eq 'POST' && $_->{path} !~ m{^/slots}
                 && !LlamaTest::prefix_call($_) }
            @{ $t->fake_calls };
    my $b = eval { $JSON->decode($c[-1]{body}) } // {};
    return $b->{id_slot};
}

# four sessions, four empty slots
my %slot;
for my $sid (qw(s1 s2 s3 s4)) {
    my $r = ask($sid);
    $slot{$sid} = $r->{slot};
    is(pinned(), $r->{slot}, "$sid runs pinned to its slot $r->{slot}");
}
is(scalar(keys %{ { reverse %slot } }), 4, 'four sessions take the four '
   . 'empty slots');

# s2's slot is saved and unchanged: the next new session takes it
my $r = $t->post("/api/sessions/save?slot=$slot{s2}", {});
is($r->{status}, 200, 'the API saves one slot with ?slot=');
is(scalar @{ $r->{json}{saved} }, 1, 'that slot alone');
my $n = grep { $_->{path} =~ /^\/slots\/\d+$/ && $_->{query} eq 'action=save' }
        @{ $t->fake_calls };
$r = ask('s5');
is($r->{slot}, $slot{s2}, 's5 takes the slot of s2, saved and unchanged, '
   . 'not the least recently used');
is(scalar(grep { $_->{path} =~ /^\/slots\/\d+$/ && $_->{query} eq 'action=save' }
          @{ $t->fake_calls }), $n, 'and saves nothing for it');
$slot{s5} = delete $slot{s2};

# the least recently used next: s1's
$r = ask('s6');
is($r->{slot}, $slot{s1}, 's6 takes the least recently used slot (s1\'s)');
$slot{s6} = delete $slot{s1};

# a request without an id takes a named session's slot only when it must
$r = $t->post("/api/sessions/clear?slot=$slot{s3}", {});
is($r->{status}, 200, 'the API clears one slot with ?slot=');
$r = ask(undef);
is($r->{id}, 'default', 'a request without an id is "default"');
is($r->{slot}, $slot{s3}, 'and takes the empty slot');
my $default_slot = $r->{slot};

# a new named session takes the slot of "default" (never saved) before
# the least recently used named one
$r = ask('s7');
is($r->{slot}, $default_slot, 's7 takes the slot that held "default"');

# sessions in slots stay there
for my $sid (qw(s4 s5 s6)) {
    $r = ask($sid);
    is($r->{action}, 'hit', "$sid is a hit");
    is($r->{slot}, $slot{$sid}, "in its own slot $slot{$sid}");
}

# a client's id_slot never wins, in any body position
$r = ask('s4', extra => { id_slot => ($slot{s4} + 1) % 4 });
is(pinned(), $slot{s4}, 'a client\'s id_slot is overridden (the module\'s '
   . 'comes last)');
my @c = grep { $_->{method} eq 'POST' && $_->{path} !~ m{^/slots}
                 && !LlamaTest::prefix_call($_) }
        @{ $t->fake_calls };
like($c[-1]{body}, qr/"id_slot":\d+,.*"id_slot":$slot{s4}\}$/,
     'both are in the body, the module\'s last');

# an empty object and a body in a temporary file
$r = $t->request('POST', '/v1/completions', body => '{}',
                 headers => { 'X-Session-Id' => 's4',
                              'Content-Type' => 'application/json' });
is($r->{status}, 200, 'an empty object is served');
is(pinned(), $r->{headers}{'x-s-slot'}, 'and pinned');
my $big = { prompt => 'x' x 300_000 };
$r = $t->post('/v1/completions', $big, headers => { 'X-Session-Id' => 'big' });
is($r->{status}, 200, 'a 300 KB body (in a temporary file) is served');
@c = grep { $_->{method} eq 'POST' && $_->{path} !~ m{^/slots}
                 && !LlamaTest::prefix_call($_) }
     @{ $t->fake_calls };
is($c[-1]{body_len}, length($JSON->encode($big))
   + length(qq(,"id_slot":$r->{headers}{'x-s-slot'})),
   'pinned, with the right length');

# white space after the object does not hide it; a body that is no object
# is never sent unpinned
$r = $t->request('POST', '/v1/completions',
                 body => '{"prompt":"padded"}' . (" \n" x 400),
                 headers => { 'X-Session-Id' => 'padded',
                              'Content-Type' => 'application/json' });
is($r->{status}, 200, 'a body with 800 bytes of white space after it');
is(pinned(), $r->{headers}{'x-s-slot'}, 'is pinned all the same');
$n = @{ $t->fake_calls };
$r = $t->request('POST', '/v1/completions', body => '["not", "an object"]',
                 headers => { 'X-Session-Id' => 'array',
                              'Content-Type' => 'application/json' });
is($r->{status}, 400, 'a body that is no JSON object: 400');
like($r->{content}, qr/must be a JSON object/, 'with the reason');
ok(!(grep { $_->{method} eq 'POST' && $_->{path} !~ m{^/slots}
                 && !LlamaTest::prefix_call($_) }
     @{ $t->fake_calls }[$n .. $#{ $t->fake_calls }]),
   'and never reaches llama-server');

# slots=auto: the backend's slot count, learned at the first request
$t->stop_nginx;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=auto:1m slots=auto store=%%SLOTS%%;',
    upstream => '',
    server => 'add_header X-S-Slot $llama_session_slot always;',
    extra => 'location /api/ { llama_session_api auto; }'));
is(scalar @{ $t->get('/api/sessions/current')->{json}{slots} }, 0,
   'slots=auto: no slot before the first request');
my %seen;
for my $sid (map { "auto$_" } 1 .. 4) {
    $r = $t->post('/v1/chat/completions',
                  { messages => [ { role => 'user', content => $sid } ] },
                  headers => { 'X-Session-Id' => $sid });
    is($r->{status}, 200, "slots=auto: $sid is served");
    $seen{ $r->{headers}{'x-s-slot'} }++;
}
is(scalar keys %seen, 4, 'on the four slots llama-server has');
is(scalar @{ $t->get('/api/sessions/current')->{json}{slots} }, 4,
   'the API shows four slots');
ok($t->log_lines(qr/zone "auto" drives the 4 slots of its backend \(slots=auto\)/),
   'the count is logged');

$t->stop;
done_testing;
