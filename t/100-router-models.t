#!/usr/bin/perl

# One zone for all the models of llama-server's router (models=N), with the
# real llama-server: three models (the rig's model with 4, 8 and 12
# layers) and --models-max 1, so every switch unloads the other model.  No
# model is listed in nginx.conf: each gets a zone of the set ("r.1",
# "r.2", ...) when it is first asked for and the router lists it, never
# for a name a client makes up; sessions of each keep their caches across
# the unloads; the bindings and the files survive a restart of nginx; a
# full set refuses a new model with 503; the API and the metrics follow;
# with --models-max 2 the least recently used of the set's models goes.
# On the fake router: GET /models failing, or slow while its client
# leaves, and a link planted where the binding's file is written.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use HTTP::Tiny;
use LlamaTest;
use Test::More;

my %layers = (small => 4, mid => 8, big => 12);

sub config {
    my ($models) = @_;
    return <<"EOF2";
    llama_session_zone zone=r:1m models=$models store=%%SLOTS%%;

    server {
        listen 127.0.0.1:%%PORT%%;

        location / {
            llama_session r;
            llama_session_wait_timeout 120s;
            proxy_pass http://127.0.0.1:%%LLAMA%%;
            proxy_read_timeout 300s;
            add_header X-S-Action \$llama_session_action always;
            add_header X-S-Key \$llama_session_key always;
        }

        location /api/ { llama_session_api r; }
        location = /metrics { llama_session_metrics r; }

        location /_llama_slots/ {
            internal;
            proxy_pass http://127.0.0.1:%%LLAMA%%/;
            proxy_read_timeout 300s;
        }
    }
EOF2
}

my (%conv, $t);

sub ask {
    my ($sid, $model) = @_;
    $conv{"$sid/$model"} //= [
        { role => 'system', content => "You answer for $sid." },
        { role => 'user', content => join ' ', map {
              "Session $sid on $model keeps note $_." } 1 .. 40 } ];
    return $t->post('/v1/chat/completions',
                    { model => $model, messages => $conv{"$sid/$model"},
                      max_tokens => 2, temperature => 0 },
                    headers => { 'X-Session-Id' => $sid });
}

sub turn {
    my ($sid, $model) = @_;
    my $r = ask($sid, $model);
    die "$sid: $r->{status} $r->{content}\n" unless $r->{status} == 200;
    push @{ $conv{"$sid/$model"} },
        { role => 'assistant',
          content => $r->{json}{choices}[0]{message}{content} },
        { role => 'user', content => "And then, $sid?" };
    return { prompt => $r->{json}{usage}{prompt_tokens},
             cached => $r->{json}{timings}{cache_n} // 0,
             model => $r->{json}{model},
             action => $r->{headers}{'x-s-action'},
             key => $r->{headers}{'x-s-key'} };
}

sub binding {
    my ($zone) = @_;
    open my $fh, '<', "$t->{slots}/$zone.model" or return undef;
    local $/;
    return scalar <$fh>;
}

# the binding as it is once written (in a thread of the store's, after
# the zone took the model)
sub bound {
    my ($zone) = @_;
    $t->wait_for(sub { defined binding($zone) }, 5);
    return binding($zone);
}

sub files {
    my ($prefix) = @_;
    opendir my $d, $t->{slots} or die;
    return [ grep { /^\Q$prefix\E@.*\.bin$/ } readdir $d ];
}

# --- nginx -t: what a set of zones needs ----------------------------------

$t = LlamaTest->new(workers => 2);

for my $case (
    [ 'models=0', 'zone=r:1m models=0 store=%%SLOTS%%',
      qr/invalid number of models "models=0": 1 to 64/ ],
    [ 'model= and models=', 'zone=r:1m model=a models=2 store=%%SLOTS%%',
      qr/zone "r" has "model=" and "models="/ ],
    [ 'no store', 'zone=r:1m models=2',
      qr/zone "r" with "models=" needs "store="/ ],
    [ 'slots=auto', 'zone=r:1m models=2 slots=auto store=%%SLOTS%%',
      qr/zone "r" with "models=" cannot have "slots=auto"/ ],
    [ 'a long name', 'zone=abcdefghijklmn:1m models=2 store=%%SLOTS%%',
      qr/needs a name of 1 to 13 letters/ ]) {
    my ($what, $zone, $re) = @$case;
    my ($rc, $out) = $t->nginx_test(<<"EOF2");
    llama_session_zone $zone;
    server {
        listen 127.0.0.1:%%PORT%%;
        location / { llama_session r; proxy_pass http://127.0.0.1:1; }
        location /_llama_slots/ { internal; proxy_pass http://127.0.0.1:1/; }
    }
EOF2
    isnt($rc, 0, "nginx -t refuses $what");
    like($out, $re, 'and names the problem');
}

{
    my ($rc, $out) = $t->nginx_test(<<'EOF2');
    llama_session_zone zone=r:1m models=2 store=%%SLOTS%%;
    llama_session_zone zone=r.2:1m;
    server {
        listen 127.0.0.1:%%PORT%%;
        location / { llama_session r; proxy_pass http://127.0.0.1:1; }
        location /_llama_slots/ { internal; proxy_pass http://127.0.0.1:1/; }
    }
EOF2
    isnt($rc, 0, 'a zone named as one of the set: refused');
    like($out, qr/duplicate llama_session_zone "r.2"/, 'as a duplicate');
}

$t->stop;

# --- the router's list fails, or is slow and the client leaves (fake) -----

$t = LlamaTest->new(workers => 2);
$t->fake(script => { router => 1, router_list => [ 'small' ],
                     router_models => { status => 500 } });
$t->nginx(config(2));

my $f1 = ask('f', 'small');
is($f1->{status}, 502, 'GET /models fails: 502');
is($f1->{json}{error}{type}, 'server_error', 'as JSON');
ok(!defined binding('r.1'), 'no zone was given a model');
ok($t->log_lines(qr/GET \/models/), 'the error log names the call');

$t->fake_script({ router => 1, router_list => [ 'small' ],
                  router_models => { delay_ms => 1500 } });
my $gone = HTTP::Tiny->new(timeout => 0.5)->post(
    $t->url('/v1/chat/completions'),
    { headers => { 'Content-Type' => 'application/json',
                   'X-Session-Id' => 'gone' },
      content => '{"model":"small","max_tokens":2,'
                 . '"messages":[{"role":"user","content":"hi"}]}' });
is($gone->{status}, 599, 'a client that leaves during GET /models');
sleep 2;
$t->fake_script({ router => 1, router_list => [ 'small' ] });

# a link planted where the binding's temporary file goes is never followed
my $victim = $t->dir . '/victim';
open my $vf, '>', $victim or die;
print $vf "keep\n";
close $vf;
symlink $victim, "$t->{slots}/r.1.model.tmp" or die "symlink: $!";

my $f2 = ask('f', 'small');
is($f2->{status}, 200, 'the next request goes on: 200')
    or diag $f2->{content};
like($f2->{headers}{'x-s-key'} // '', qr/^r\.1@/, 'on r.1');
is(bound('r.1'), "small\n", 'given small once');
ok(!-l "$t->{slots}/r.1.model", 'in a file of its own, not a link');
is($t->read_file('victim'), "keep\n",
   'the file a planted link pointed to is untouched');
ok(!defined binding('r.2'), 'and only r.1');

$t->stop;

# --- one zone, three models, --models-max 1 -------------------------------

$t = LlamaTest->new(workers => 2);
$t->router(models => \%layers, max => 1);
$t->nginx(config(3));

# two clients ask for a new model at once, in two workers: one zone for it
my %h = map { $_ => $t->async_post('/v1/chat/completions',
                  { model => 'big', max_tokens => 2, temperature => 0,
                    messages => [ { role => 'user', content => "Hi $_." } ] },
                  headers => { 'X-Session-Id' => $_ }) } qw(p q);
for my $sid (qw(p q)) {
    my $r = $t->async_wait($h{$sid}, 120);
    is($r->{status}, 200, "$sid on big, at once: 200") or diag $r->{content};
    like($r->{headers}{'x-s-key'} // '', qr/^r\.1@/, "$sid is on r.1");
}

my $a1 = turn('a', 'big');
is($a1->{cached}, 0, 'a\'s first turn on big is a prefill');
like($a1->{key}, qr/^r\.1@/, 'on the set\'s first zone');
is(bound('r.1'), "big\n", 'which keeps the model in the store: r.1.model');

# a model the router does not list never gets a zone

for my $name ('nosuch', 'big2', '../../etc', 'x' x 65, '') {
    my $r = ask('intruder', $name);
    is($r->{status}, 400, "a made-up model \"" . substr($name, 0, 12)
                          . "\": 400");
    is($r->{json}{error}{type}, 'invalid_request_error', 'as JSON');
}
ok(!defined binding('r.2'), 'and no zone was given to one');
ok($t->log_lines(qr/router has no model "nosuch" \(zone "r"\): refused/),
   'the error log says why');

my $b1 = turn('b', 'small');
like($b1->{key}, qr/^r\.2@/, 'b on small: the next zone of the set');
is(bound('r.2'), "small\n", 'r.2 keeps small');
my $m = $t->router_models;
is($m->{small}, 'loaded', 'small is loaded');
is($m->{big}, 'unloaded', 'big was unloaded for it');
is(scalar @{ files('r.1') }, 3, 'a, p and q were saved before big went');
ok($t->log_lines(qr/"big" \(zone "r\.1"\) is saved and unloaded for "small"/),
   'the error log says why big went');

my $a2 = turn('a', 'big');
is($a2->{action}, 'restore', 'a returns on big: restored');
ok($a2->{cached} >= $a1->{prompt} - 1,
   "with its cache: $a2->{cached} of $a2->{prompt} tokens "
   . "(its first turn had $a1->{prompt})");
like($a2->{key}, qr/^r\.1@/, 'on the same zone');

my $c1 = turn('c', 'mid');
like($c1->{key}, qr/^r\.3@/, 'c on mid: the third zone');

# the same id on another model: another session, another zone, another file
my $a_small = turn('a', 'small');
like($a_small->{key}, qr/^r\.2@/, 'a on small runs in small\'s zone');
is($a_small->{cached}, 0, 'fresh, never from big\'s file');

my %first = (b => $b1, c => $c1, a => $a2);
for my $round (1 .. 2) {
    for my $s ([ 'a', 'big' ], [ 'b', 'small' ], [ 'c', 'mid' ]) {
        my $r = turn(@$s);
        ok($r->{cached} >= $first{ $s->[0] }{prompt} - 1,
           "round $round: $s->[0] on $s->[1] finds its cache across the "
           . "unloads: $r->{cached} of $r->{prompt}");
        $first{ $s->[0] } = $r;
    }
}

# the API: ?model= picks the model's zone

my $api = $t->get('/api/sessions/current?model=big');
is($api->{status}, 200, 'the API of the set, ?model=big: 200');
is($api->{json}{backend}{model}, 'big', 'names big');
like($t->get('/api/sessions/a?model=big')->{content}, qr/r\.1\@a-/,
     'and finds a there');
my $no = $t->get('/api/sessions');
is($no->{status}, 400, 'without ?model=: 400');
like($no->{json}{error}{message} // $no->{content}, qr/name one with \?model=/,
     'saying so');
is($t->get('/api/sessions?model=nosuch')->{status}, 404,
   'a model without a zone: 404');

my $metrics = $t->get('/metrics')->{content};
like($metrics, qr/\{zone="r\.1",model="big"[,}]/, 'the metrics label r.1 big');
like($metrics, qr/\{zone="r\.3",model="mid"[,}]/, 'and r.3 mid');

# Anthropic's API on a model of the set: translated, on the model's zone
# (greedy: random weights sampled at random write, now and then, a reply
# llama-server's own parser refuses with a 500)
my @msgs = ({ role => 'user', content => join ' ', map {
                 "Claude keeps note $_ on mid." } 1 .. 40 });
my $m1 = $t->post('/v1/messages', { model => 'mid', max_tokens => 2,
                                    temperature => 0, messages => \@msgs },
                  headers => { 'X-Claude-Code-Session-Id' => 'claude-mid' });
is($m1->{status}, 200, 'Anthropic\'s /v1/messages on the set: 200')
    or diag $m1->{content};
like($m1->{headers}{'x-s-key'} // '', qr/^r\.3@/, 'on mid\'s zone');
push @msgs, { role => 'assistant', content => 'ok' },
            { role => 'user', content => 'And then?' };
turn('b', 'small');
my $m2 = $t->post('/v1/messages', { model => 'mid', max_tokens => 2,
                                    temperature => 0, messages => \@msgs },
                  headers => { 'X-Claude-Code-Session-Id' => 'claude-mid' });
my $u1 = $m1->{json}{usage} // {};
my $mfirst = ($u1->{input_tokens} // 0) + ($u1->{cache_read_input_tokens} // 0);
cmp_ok($m2->{json}{usage}{cache_read_input_tokens} // 0, '>=',
       $mfirst > 100 ? $mfirst - 1 : 1e9,
       'its next turn, after small had the router, reads its history from '
       . 'the cache');

# a reload to models=4: the zones keep their models, r.4 has none yet

$t->nginx(config(4), write_only => 1);
$t->reload;
$t->wait_for(sub { $t->get('/metrics')->{content} =~ /zone="r\.4"/ }, 10);
my $a_r = turn('a', 'big');
like($a_r->{key}, qr/^r\.1@/, 'after a reload a is on r.1');
ok($a_r->{cached} >= $first{a}{prompt} - 1,
   "with its cache: $a_r->{cached} of $a_r->{prompt}");
$first{a} = $a_r;
$metrics = $t->get('/metrics')->{content};
like($metrics, qr/\{zone="r\.4"[,}]/, 'the metrics show r.4, no model');
like($metrics, qr/\{zone="r\.2",model="small"[,}]/, 'r.2 is small\'s');

# small takes the router, then big again: each one's turn since the
# reload is saved with its model's unload (after a restart the sessions
# come from their files: nothing vouches for what a slot holds)
$first{b} = turn('b', 'small');
$first{a} = turn('a', 'big');
turn('c', 'mid');

ok(!$t->log_lines(qr/lost their turns|\[(alert|crit|emerg)\]/),
   'no session lost a turn');

# --- nginx restarts: the zones keep their models and files ---------------

$t->stop_nginx;
$t->nginx(config(3));

my $a3 = turn('a', 'big');
like($a3->{key}, qr/^r\.1@/, 'after a restart a is on r.1 again');
is($a3->{action}, 'restore', 'restored from its file');
ok($a3->{cached} >= $first{a}{prompt} - 1,
   "with its cache: $a3->{cached} of $a3->{prompt}");
my $c2 = turn('c', 'mid');
like($c2->{key}, qr/^r\.3@/, 'c is on r.3 again');

# --- a set of two: the third model is refused -----------------------------

$t->stop_nginx;
$t->nginx(config(2));

my $b2 = turn('b', 'small');
like($b2->{key}, qr/^r\.2@/, 'models=2: small is on r.2 still');
ok($b2->{cached} >= $first{b}{prompt} - 1,
   "b restored: $b2->{cached} of $b2->{prompt}");
my $full = ask('c', 'mid');
is($full->{status}, 503, 'mid, a third model for a set of two: 503');
is($full->{json}{error}{type}, 'unavailable_error', 'as JSON');
ok($t->log_lines(qr/zone "r" keeps the sessions of 2 models already/),
   'the error log says to raise models=');

ok(!$t->log_lines(qr/lost their turns|\[(alert|crit|emerg)\]/),
   'no session lost a turn');

$t->stop;

# --- --models-max 2, three models in one set: the least recently used goes

%conv = ();
$t = LlamaTest->new(workers => 2);
$t->router(models => \%layers, max => 2);
$t->nginx(config(3));

my %last;
$last{x} = turn('x', 'small');
$last{y} = turn('y', 'mid');
$m = $t->router_models;
is_deeply([ $m->{small}, $m->{mid} ], [ 'loaded', 'loaded' ],
          'max 2: small and mid are loaded');
$last{z} = turn('z', 'big');
$m = $t->router_models;
is($m->{small}, 'unloaded', 'big takes the place of small, used longest ago');
is($m->{mid}, 'loaded', 'mid stays');

for my $s ([ 'x', 'small' ], [ 'y', 'mid' ], [ 'z', 'big' ]) {
    my $r = turn(@$s);
    ok($r->{cached} >= $last{ $s->[0] }{prompt} - 1,
       "$s->[0] on $s->[1] finds its cache: $r->{cached} of $r->{prompt}");
    my @running = grep { $t->router_models->{$_} ne 'unloaded' }
                  keys %layers;
    ok(@running <= 2, 'never more than 2 models run: ' . join ',', sort @running);
}

ok(!$t->log_lines(qr/lost their turns|\[(alert|crit|emerg)\]/),
   'no session lost a turn');

$t->stop;
done_testing;
