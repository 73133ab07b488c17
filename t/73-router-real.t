#!/usr/bin/perl

# llama-server's router mode with the real llama-server: three models of
# different sizes (the rig's model with 4, 8 and 12 layers), a zone each
# over the router's one --slot-save-path, the zone chosen by the request's
# "model".  With --models-max 1 every other request makes the router unload
# a model: the module saves that model's changed sessions first, unloads
# it, loads the request's, and every returning session finds its cache.
# With --models-max 2 the least recently used of the loaded models goes.
# A model unloaded behind the module's back loses only its latest turns.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my %layers = (small => 4, mid => 8, big => 12);

sub config {
    return <<'EOF2';
    llama_session_zone zone=small:1m model=small store=%%SLOTS%%;
    llama_session_zone zone=mid:1m model=mid store=%%SLOTS%%;
    llama_session_zone zone=big:1m model=big store=%%SLOTS%%;

    server {
        listen 127.0.0.1:%%PORT%%;

        location / {
            llama_session small mid big;
            llama_session_wait_timeout 120s;
            proxy_pass http://127.0.0.1:%%LLAMA%%;
            proxy_read_timeout 300s;
            add_header X-S-Action $llama_session_action always;
            add_header X-S-Key $llama_session_key always;
        }

        location /api/small/ { llama_session_api small; }
        location /api/big/ { llama_session_api big; }

        location /_llama_slots/ {
            internal;
            proxy_pass http://127.0.0.1:%%LLAMA%%/;
            proxy_read_timeout 300s;
        }
    }
EOF2
}

my (%conv, $t);

sub turn {
    my ($sid, $model) = @_;
    $conv{$sid} //= [ { role => 'system', content => "You answer for $sid." },
                      { role => 'user', content => join ' ', map {
                            "Session $sid on $model keeps note $_." } 1 .. 40 } ];
    my $r = $t->post('/v1/chat/completions',
                     { model => $model, messages => $conv{$sid},
                       max_tokens => 2, temperature => 0 },
                     headers => { 'X-Session-Id' => $sid });
    die "$sid: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    push @{ $conv{$sid} },
        { role => 'assistant',
          content => $r->{json}{choices}[0]{message}{content} },
        { role => 'user', content => "And then, $sid?" };
    return { prompt => $r->{json}{usage}{prompt_tokens},
             cached => $r->{json}{timings}{cache_n} // 0,
             model => $r->{json}{model},
             action => $r->{headers}{'x-s-action'},
             key => $r->{headers}{'x-s-key'} };
}

sub files {
    my ($prefix) = @_;
    opendir my $d, $t->{slots} or die;
    my %f = map { $_ => -s "$t->{slots}/$_" }
            grep { /^\Q$prefix\E@.*\.bin$/ } readdir $d;
    return \%f;
}

# --- --models-max 1: every switch unloads the other model ------------------

$t = LlamaTest->new(workers => 2);
$t->router(models => \%layers, max => 1);
$t->nginx(config());

my $a1 = turn('a', 'big');
is($a1->{cached}, 0, 'max 1: a\'s first turn on big is a prefill');
like($a1->{key}, qr/^big@/, 'its key starts with its zone');
is($t->router_models->{big}, 'loaded', 'big is loaded');

my $b1 = turn('b', 'small');
is($b1->{cached}, 0, 'b on small: a prefill');
my $m = $t->router_models;
is($m->{small}, 'loaded', 'small is loaded');
is($m->{big}, 'unloaded', 'big was unloaded for it');
is(scalar keys %{ files('big') }, 1, 'a was saved before big went');
ok($t->log_lines(qr/"big" \(zone "big"\) is saved and unloaded for "small"/),
   'the error log says why big went');

my $a2 = turn('a', 'big');
ok($a2->{cached} >= $a1->{prompt} - 1,
   "a returns on big after small had the router: $a2->{cached} of "
   . "$a2->{prompt} tokens cached (its first turn had $a1->{prompt})");
is($a2->{action}, 'restore', 'from its file');
is($t->router_models->{small}, 'unloaded', 'small went for it');

my $b2 = turn('b', 'small');
ok($b2->{cached} >= $b1->{prompt} - 1,
   "b returns on small: $b2->{cached} of $b2->{prompt} cached");

# the isolation review: a body whose "model" the module and the router
# could read differently (a duplicate member, an escaped key) runs on the
# zone of the model the router runs, never on another zone's slot

for my $case (
    [ 'a duplicate "model": the last is the one',
      '{"model":"mid","messages":%s,"max_tokens":2,"temperature":0,"model":"small"}' ],
    [ 'an escaped key "mod\\u0065l" is "model"',
      '{"model":"mid","messages":%s,"max_tokens":2,"temperature":0,"mod\\u0065l":"small"}' ],
    [ 'a UTF-8 BOM before the body',
      "\xef\xbb\xbf" . '{"model":"small","messages":%s,"max_tokens":2,"temperature":0}' ]) {
    my ($what, $fmt) = @$case;
    my $msgs = $LlamaTest::JSON->encode([ { role => 'user',
        content => join ' ', map { "Crafted note $_." } 1 .. 30 } ]);
    my $r = $t->request('POST', '/v1/chat/completions',
                        body => sprintf($fmt, $msgs),
                        headers => { 'Content-Type' => 'application/json',
                                     'X-Session-Id' => 'crafted' });
    is($r->{status}, 200, "$what: 200");
    is($r->{json}{model}, 'small', "$what: the router ran small");
    like($r->{headers}{'x-s-key'} // '', qr/^small@/,
         "$what: on zone small's slot");
}

# clients do not drive the router's models: model management and any
# request outside the endpoints that may name a model are refused, and no
# model is loaded or unloaded by them

my $before = $t->router_models;
for my $req ([ 'POST', '/models/unload', { model => 'small' } ],
             [ 'POST', '/models/load', { model => 'mid' } ],
             [ 'POST', '/models', { model => 'mid' } ],
             [ 'DELETE', '/models', undef ],
             [ 'GET', '/props?model=mid', undef ],
             [ 'POST', '/tokenize', { model => 'mid', content => 'hi' } ],
             [ 'POST', '/apply-template', { model => 'mid', messages => [] } ]) {
    my ($m, $path, $body) = @$req;
    my $r = $t->request($m, $path, defined $body ? (body => $body) : ());
    is($r->{status}, 403, "a client's $m $path: 403");
    is($r->{json}{error}{type}, 'permission_error', 'as JSON');
}
is_deeply($t->router_models, $before, 'no model was loaded or unloaded');
is($t->get('/models')->{status}, 200, 'GET /models, the list, passes');
ok($t->log_lines(qr/refused a client's call to "\/models\/unload": the models are the module's/),
   'the error log says why');

# the same id and messages on another model: another session, another file

my $c1 = turn('c', 'big');
my $c1s = do { local $conv{c} = [ @{ $conv{c} }[0, 1] ]; turn('c', 'small') };
isnt($c1->{key}, $c1s->{key}, 'one id on two models: two sessions');
is($c1s->{cached}, 0, 'c on small starts fresh, never from big\'s file');

my ($big) = values %{ files('big') };
my ($small) = values %{ files('small') };
ok($big > 2 * $small,
   "a big file ($big bytes) is not a small one ($small bytes)");

my %fp;
for my $f (keys %{ files('big') }, keys %{ files('small') }) {
    my ($z, $fp) = $f =~ /^(\w+)@.*\.([0-9a-f]{8})\.bin$/ or next;
    $fp{$z}{$fp} = 1;
}
is(scalar keys %{ $fp{big} }, 1, 'big\'s files have one fingerprint');
ok(!grep({ $fp{small}{$_} } keys %{ $fp{big} }),
   'which is not small\'s: a file is never restored into the other model');

my $api = $t->get('/api/big/sessions/current')->{json};
is($api->{backend}{model}, 'big', 'the API names the zone\'s model');
ok($api->{stats}{unloads} >= 2, "and counts its unloads: $api->{stats}{unloads}");
my $list = $t->get('/api/big/sessions/a')->{json};
ok(ref $list eq 'HASH' || ref $list eq 'ARRAY', 'the API finds a by its id');
like($t->get('/api/big/sessions/a')->{content}, qr/big\@a-/,
     'under its key in the zone');

my $a3 = turn('a', 'big');
ok($a3->{cached} >= $a2->{prompt} - 1,
   "a's third turn: $a3->{cached} of $a3->{prompt} cached");

# behind the module's back: big unloaded by another client, a's last turn
# not saved (nothing switched since): a comes back from its older file

my $a4 = turn('a', 'big');
my $u = $t->{http}->post("http://127.0.0.1:$t->{llama_port}{llama}/models/unload",
                         { content => '{"model":"big"}' });
is($u->{status}, 200, 'another client unloads big');
$t->wait_for(sub { $t->router_models->{big} eq 'unloaded' }, 20);

my $a5 = turn('a', 'big');
is($a5->{action}, 'restore', 'a returns: restored from its last file');
ok($a5->{cached} > 0 && $a5->{cached} < $a4->{prompt},
   "which misses only the turns since it: $a5->{cached} of $a5->{prompt}");
ok($t->log_lines(qr/model "big" \(zone "big"\) is not running behind the module's back: 1 sessions lost/),
   'the error log says so');

$t->stop;

# --- --models-max 2, three models: the least recently used one goes -------

%conv = ();
$t = LlamaTest->new(workers => 2);
$t->router(models => \%layers, max => 2);
$t->nginx(config());

my %first;
$first{x} = turn('x', 'small');
$first{y} = turn('y', 'mid');
$m = $t->router_models;
is_deeply([ $m->{small}, $m->{mid} ], [ 'loaded', 'loaded' ],
          'max 2: small and mid are loaded');

$first{z} = turn('z', 'big');
$m = $t->router_models;
is($m->{small}, 'unloaded', 'big takes the place of small, used longest ago');
is($m->{mid}, 'loaded', 'mid stays');

for my $round (1 .. 2) {
    for my $s ([ 'x', 'small' ], [ 'y', 'mid' ], [ 'z', 'big' ]) {
        my $r = turn(@$s);
        ok($r->{cached} >= $first{ $s->[0] }{prompt} - 1,
           "round $round: $s->[0] on $s->[1] finds its cache: "
           . "$r->{cached} of $r->{prompt}");
        $first{ $s->[0] } = $r;
        my @running = grep { $t->router_models->{$_} ne 'unloaded' }
                      keys %layers;
        ok(@running <= 2, 'never more than 2 models run: ' . join ',', sort @running);
    }
}

ok(!$t->log_lines(qr/lost their turns|\[(alert|crit|emerg)\]/),
   'no session lost a turn');

$t->stop;

# --- --models-max 1, clients of two models at once --------------------------

%conv = ();
$t = LlamaTest->new(workers => 2);
$t->router(models => { small => 4, big => 12 }, max => 1);
$t->nginx(config());

my @clients = ([ 'p', 'small' ], [ 'q', 'big' ], [ 'r', 'small' ],
               [ 's', 'big' ]);
my %last;

for my $c (@clients) {
    $last{ $c->[0] } = turn(@$c);
}

for my $round (1 .. 3) {
    my %h;
    for my $c (@clients) {
        my ($sid, $model) = @$c;
        $h{$sid} = $t->async_post('/v1/chat/completions',
                                  { model => $model, messages => $conv{$sid},
                                    max_tokens => 2, temperature => 0 },
                                  headers => { 'X-Session-Id' => $sid });
    }
    for my $c (@clients) {
        my ($sid, $model) = @$c;
        my $r = $t->async_wait($h{$sid}, 120);
        is($r->{status}, 200, "round $round: $sid on $model at once: 200")
            or diag $r->{content};
        my $cached = $r->{json}{timings}{cache_n} // 0;
        ok($cached >= $last{$sid}{prompt} - 1,
           "and finds its cache: $cached of "
           . ($r->{json}{usage}{prompt_tokens} // '?'));
        $last{$sid} = { prompt => $r->{json}{usage}{prompt_tokens} // 0 };
        push @{ $conv{$sid} },
            { role => 'assistant',
              content => $r->{json}{choices}[0]{message}{content} // '' },
            { role => 'user', content => "And then, $sid?" };
    }
}

# Anthropic's API on a model of the router: translated, routed by its
# model, and its session's next turn cached
my @msgs = ({ role => 'user', content => join ' ', map {
                 "Claude keeps note $_ on big." } 1 .. 40 });
my $r1 = $t->post('/v1/messages', { model => 'big', max_tokens => 2,
                                    messages => \@msgs },
                  headers => { 'X-Claude-Code-Session-Id' => 'claude-big' });
is($r1->{status}, 200, 'Anthropic\'s /v1/messages on the router: 200')
    or diag $r1->{content};
is($r1->{json}{type}, 'message', 'an Anthropic message');
push @msgs, { role => 'assistant', content => 'ok' },
            { role => 'user', content => 'And then?' };
my $r2 = $t->post('/v1/messages', { model => 'big', max_tokens => 2,
                                    messages => \@msgs },
                  headers => { 'X-Claude-Code-Session-Id' => 'claude-big' });
my $u1 = $r1->{json}{usage} // {};
my $first = ($u1->{input_tokens} // 0) + ($u1->{cache_read_input_tokens} // 0);
cmp_ok($r2->{json}{usage}{cache_read_input_tokens} // 0, '>=',
       $first > 100 ? $first - 1 : 1e9,
       'its next turn reads its history from the cache');

ok(!$t->log_lines(qr/lost their turns|\[(alert|crit|emerg)\]/),
   'no session lost a turn');

$t->stop;
done_testing;
